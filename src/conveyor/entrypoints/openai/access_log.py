"""The access log: one line per HTTP request, written when its response has been sent, with the
request id, method and path, status, prompt and output tokens and latency. The prompt text is
logged only when asked for (``--log-prompts``); headers, and with them API keys, never are."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("conveyor.access")

_SCOPE_KEY = "conveyor.access"
MAX_LOGGED_PROMPT_CHARS = 2000


@dataclass(frozen=True)
class AccessLogSettings:
    enabled: bool = False
    log_prompts: bool = False


@dataclass
class AccessRecord:
    """What a handler tells the access log about its request."""

    request_id: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prompt: str | None = None  # kept only with --log-prompts


def access_record(request: Request) -> AccessRecord:
    """The record of this request (a detached one when the access log is off)."""
    record = request.scope.get(_SCOPE_KEY)
    return record if record is not None else AccessRecord("")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, log_prompts: bool = False) -> None:
        self.app = app
        self.log_prompts = log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        record = AccessRecord(f"req-{uuid.uuid4().hex}")
        scope[_SCOPE_KEY] = record
        status = 500  # what the client gets if the app fails before answering

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, status_send)
        finally:
            self._log(scope, record, status, time.perf_counter() - start)

    def _log(self, scope: Scope, record: AccessRecord, status: int, latency: float) -> None:
        client = scope.get("client")
        # The path as it arrived (still percent-encoded), escaped: no request can write a
        # second line, or a quote that ends this field, into the log.
        path = scope.get("raw_path") or scope["path"].encode()
        parts = [record.request_id, f"{client[0]}:{client[1]}" if client else "-",
                 f'"{_escaped(scope["method"])} {_escaped(path.decode("latin-1"))}"', str(status),
                 f"prompt_tokens={_count(record.prompt_tokens)}",
                 f"output_tokens={_count(record.output_tokens)}", f"latency={latency:.3f}s"]
        if self.log_prompts and record.prompt is not None:
            parts.append(f"prompt={record.prompt[:MAX_LOGGED_PROMPT_CHARS]!r}")
        logger.info(" ".join(parts))


def _escaped(text: str) -> str:
    """``text`` with quotes, backslashes, control and non-ASCII characters escaped as in JSON."""
    return json.dumps(text)[1:-1]


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)
