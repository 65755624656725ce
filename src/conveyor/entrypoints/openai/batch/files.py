"""Uploaded files (``/v1/files``): each file's bytes and its OpenAI file object, stored under
the state folder (``<dir>/files/<id>.bin`` and ``<id>.json``, written whole then renamed into
place, so that a crash leaves either the file or nothing)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from conveyor.entrypoints.openai.errors import APIError, bad_request

PURPOSES = ("batch", "batch_output", "user_data", "fine-tune", "assistants", "vision", "evals")


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` into ``path`` whole: a temporary file beside it, flushed, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root / "files"  # made on the first upload

    def _meta(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise APIError(404, f"No such file: {file_id!r}", param="file_id",
                           code="file_not_found")
        return self.root / f"{file_id}.json"

    def content_path(self, file_id: str) -> Path:
        self.get(file_id)
        return self.root / f"{file_id}.bin"

    def create(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise bad_request(f"'purpose' must be one of {', '.join(PURPOSES)}", param="purpose")
        file_id = f"file-{uuid.uuid4().hex}"
        obj = {"id": file_id, "object": "file", "bytes": len(data),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "status_details": None, "expires_at": None}
        write_atomic(self.root / f"{file_id}.bin", data)
        write_atomic(self._meta(file_id), json.dumps(obj).encode())
        return obj

    def get(self, file_id: str) -> dict[str, Any]:
        path = self._meta(file_id)
        if not path.exists():
            raise APIError(404, f"No such file: {file_id!r}", param="file_id",
                           code="file_not_found")
        return json.loads(path.read_text())

    def list(self, purpose: str | None = None, limit: int = 10000,
             after: str | None = None, order: str = "desc") -> dict[str, Any]:
        files = [json.loads(p.read_text()) for p in self.root.glob("file-*.json")]
        files = [f for f in files if purpose is None or f["purpose"] == purpose]
        files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=order == "desc")
        if after is not None:
            ids = [f["id"] for f in files]
            files = files[ids.index(after) + 1:] if after in ids else []
        page = files[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(files) > limit}

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        (self.root / f"{file_id}.bin").unlink(missing_ok=True)
        self._meta(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}
