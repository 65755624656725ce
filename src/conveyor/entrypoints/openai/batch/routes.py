"""The ``/v1/files`` and ``/v1/batches`` routes over a FileStore and a BatchManager kept under
the server's state folder (``--batch-dir``). A batch's body is parsed as every JSON route's
(``serving.parse_body``); an upload's ``purpose`` is checked to be Unicode text that encodes,
and its lines when a batch reads them (``lines.read_lines``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import UploadFile

from conveyor.entrypoints.openai.batch.batches import BatchManager
from conveyor.entrypoints.openai.batch.files import FileStore
from conveyor.entrypoints.openai.errors import bad_request
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.serving import parse_body
from conveyor.entrypoints.openai.state import ServerState
from conveyor.entrypoints.openai.unicode_text import check_value


def default_batch_dir() -> Path:
    from conveyor.model.kernels.build import cache_dir

    return cache_dir() / "batches"


class BatchRequest(RequestModel):
    """The body of ``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # OpenAI's; outputs here never expire


def register_batches(app: FastAPI, state: ServerState, limits: ServerLimits,
                     root: Path | None = None) -> BatchManager:
    """The routes on ``app``; the manager is returned for the app's lifespan to start/stop."""
    root = root or default_batch_dir()
    files = FileStore(root)
    batches = BatchManager(root, files, app, state, invalid_unicode=limits.invalid_unicode)

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
        # A form's text is decoded by the charset its Content-Type names: "unicode_escape"
        # spells a lone surrogate as JSON's escapes do.
        purpose = check_value(purpose, limits.invalid_unicode, ["purpose"])
        filename = check_value(upload.filename or "upload", limits.invalid_unicode,
                               ["file", "filename"])
        return files.create(await upload.read(), filename, purpose)

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
        body = await state.off_loop(parse_body, await request.body(), BatchRequest, limits,
                                    state.list_limits())
        return batches.create(body.model_dump())

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
