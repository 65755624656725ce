"""One request of a batch, run through the server's own routes in process: the request line's
body goes to the route's handler exactly as an HTTP request's would (same parsing, limits,
admission and engine), below the HTTP middleware (the batch's creator was already let in), and
the answer comes back as (status, JSON body) in OpenAI's error shape when it failed."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AsyncExitStack
from typing import Any

from starlette.applications import Starlette
from starlette.types import Message

from conveyor.entrypoints.openai.errors import APIError

logger = logging.getLogger("conveyor.batch")

# The routes a batch line may name (OpenAI's batch endpoints, and vLLM's pooling ones).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                   "/v1/responses", "/v1/score", "/v1/rerank")


async def dispatch(app: Starlette, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, parsed JSON body) of ``POST url`` with ``body`` through ``app``'s routes."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": url, "raw_path": url.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("batch", 0), "server": ("batch", 0), "state": {}, "app": app}
    sent = False
    never = asyncio.Event()  # the "client" of a batch request never disconnects

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        async with AsyncExitStack() as stack:  # what FastAPI's outer middleware provides
            scope["fastapi_middleware_astack"] = stack
            await app.router(scope, receive, send)
    except APIError as e:
        return e.status, e.body()
    except Exception as e:  # what the app's handler would turn into a 500
        logger.exception("batch request failed")
        return 500, APIError(500, f"internal error: {e}").body()
    try:
        return status, json.loads(b"".join(chunks) or b"null")
    except json.JSONDecodeError:
        return status, {"error": {"message": b"".join(chunks).decode(errors="replace"),
                                  "type": "server_error", "param": None, "code": None}}
