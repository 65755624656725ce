"""Server-sent events: OpenAI's ``data:`` lines, the named events of Anthropic's and the Responses
API's streams, and the streaming response that runs a callback once its stream has ended (also
for Ollama's newline-delimited JSON)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(obj: dict[str, Any] | str) -> str:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """A named server-sent event whose data carries its name as ``type``."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _StreamThenRelease(StreamingResponse):
    """A stream that calls ``on_close`` once it has ended, however it ended."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream") -> None:
        super().__init__(events, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    return _StreamThenRelease(events, on_close)


def ndjson_response(lines: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    """A stream of JSON lines (Ollama's), each ending in a newline."""
    return _StreamThenRelease(lines, on_close, media_type="application/x-ndjson")
