"""The ``/v1/files`` and ``/v1/batches`` routes over a FileStore and a BatchManager kept under
the server's state folder (``--batch-dir``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import UploadFile

from conveyor.entrypoints.openai.batch.batches import BatchManager
from conveyor.entrypoints.openai.batch.files import FileStore
from conveyor.entrypoints.openai.errors import bad_request, from_validation_error
from conveyor.entrypoints.openai.state import ServerState


def default_batch_dir() -> Path:
    from conveyor.model.kernels.build import cache_dir

    return cache_dir() / "batches"


class BatchRequest(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


async def _batch_request(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return BatchRequest.model_validate(body).model_dump()
    except ValidationError as e:
        raise from_validation_error(e) from e


def register_batches(app: FastAPI, state: ServerState, root: Path | None = None
                     ) -> BatchManager:
    """The routes on ``app``; the manager is returned for the app's lifespan to start/stop."""
    root = root or default_batch_dir()
    files = FileStore(root)
    batches = BatchManager(root, files, app, state)

    @app.post("/v1/files")
    async def create_file(request: Request) -> dict[str, Any]:
        try:
            form = await request.form()
        except Exception as e:  # not multipart, or a broken one
            raise bad_request(f"the upload must be multipart/form-data with 'file' and "
                              f"'purpose': {e}") from e
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("'file' is a required file field", param="file")
        if not isinstance(purpose, str):
            raise bad_request("'purpose' is a required field", param="purpose")
        return files.create(await upload.read(), upload.filename or "upload", purpose)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10000,
                         after: str | None = None, order: str = "desc") -> dict[str, Any]:
        return files.list(purpose, limit, after, order)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        return files.get(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return FileResponse(files.content_path(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        return files.delete(file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        return batches.create(await _batch_request(request))

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        return batches.list(limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict[str, Any]:
        return batches.get(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return await batches.cancel(batch_id)

    return batches
