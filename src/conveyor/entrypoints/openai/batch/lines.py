"""A batch's request lines (OpenAI's batch input JSONL) and their results: reading and checking
the input, running one line through the server's routes at the batch priority, and the output
and error lines in OpenAI's shape.

A line is ``{"custom_id", "method": "POST", "url", "body"}``; custom ids are unique in a batch.
A line is parsed as a request body is (``NaN``/``Infinity`` are not JSON; the body's nesting
is bounded when its route parses it) and its text checked as one (``unicode_text``): a lone UTF-16 surrogate anywhere in it
makes it a bad line naming the field, or U+FFFD under ``--invalid-unicode replace``.
A line's result goes to the output file when its request succeeded and to the error file when
it failed (``response.status_code`` and the error body). A request the server could not take
yet (503 while it starts or stops, 429 while its sequences in flight are full) is retried, not
failed: after a restart it runs again."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette

from conveyor.core.config import QueueOrder
from conveyor.entrypoints.openai.batch.dispatch import BATCH_ENDPOINTS, dispatch
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.unicode_text import check_text

# The queue priority of batch requests under --queue priority (interactive ones have 0, and a
# lower value runs first): batch work yields to interactive work.
BATCH_PRIORITY = 1000
RETRY_STATUSES = (429, 503)
RETRY_WAIT_S = 0.5


@dataclass
class Line:
    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


class LineError(ValueError):
    """A bad input line: its 1-based line number and what is wrong."""

    def __init__(self, line: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.code = code
        self.message = message


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _parse_line(number: int, raw: str, invalid_unicode: str) -> Any:
    """One line's JSON object, strictly parsed and its text checked."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise LineError(number, f"not JSON ({e.msg})", "invalid_json_line") from e
    except RecursionError as e:
        raise LineError(number, "nested too deeply", "invalid_json_line") from e
    except ValueError as e:  # NaN/Infinity, an integer of too many digits
        raise LineError(number, f"not JSON ({e})", "invalid_json_line") from e
    if not isinstance(obj, dict):
        raise LineError(number, "a line must be a JSON object")
    try:
        return check_text(raw, obj, invalid_unicode)
    except APIError as e:
        raise LineError(number, e.message, "invalid_unicode") from e
    except RecursionError as e:
        raise LineError(number, "nested too deeply", "invalid_json_line") from e


def read_lines(data: bytes, endpoint: str | None = None,
               invalid_unicode: str = "reject") -> list[Line]:
    """The request lines of a batch input file; LineError at the first bad one. ``endpoint``:
    the url every line must name (a server batch's), None for any batch endpoint;
    ``invalid_unicode``: what a lone surrogate does (``unicode_text``)."""
    lines: list[Line] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(1, f"the file is not UTF-8 ({e.reason})") from e
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        obj = _parse_line(number, raw, invalid_unicode)
        custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError(number, "'custom_id' must be a non-empty string", "missing_custom_id")
        if custom_id in seen:
            raise LineError(number, f"'custom_id' {custom_id!r} is not unique",
                            "duplicate_custom_id")
        if obj.get("method", "POST") != "POST":
            raise LineError(number, "'method' must be POST", "invalid_method")
        if url not in BATCH_ENDPOINTS or (endpoint is not None and url != endpoint):
            allowed = endpoint or ", ".join(BATCH_ENDPOINTS)
            raise LineError(number, f"'url' must be {allowed}, got {url!r}", "invalid_url")
        if not isinstance(body, dict):
            raise LineError(number, "'body' must be a JSON object", "invalid_body")
        if body.get("stream"):
            raise LineError(number, "'stream' is not supported in a batch", "invalid_body")
        seen.add(custom_id)
        lines.append(Line(len(lines), custom_id, url, body))
    if not lines:
        raise LineError(1, "the file holds no requests", "empty_file")
    return lines


def batch_body(body: dict[str, Any], queue: QueueOrder) -> dict[str, Any]:
    """A line's body as the batch runs it: at the batch priority when the queue honours one."""
    if queue is not QueueOrder.PRIORITY:
        return body
    return {**body, "priority": max(int(body.get("priority") or 0), BATCH_PRIORITY)}


async def run_line(app: Starlette, line: Line, queue: QueueOrder,
                   stopping: asyncio.Event | None = None) -> tuple[bool, dict[str, Any]] | None:
    """(succeeded, the result line) of one request line; None when the server stopped first
    (``stopping``) and the line must run again later."""
    body = batch_body(line.body, queue)
    while True:
        if stopping is not None and stopping.is_set():
            return None
        status, answer = await dispatch(app, line.url, body)
        if status not in RETRY_STATUSES:
            break
        await asyncio.sleep(RETRY_WAIT_S)
    request_id = (answer.get("id") if isinstance(answer, dict) else None) or \
        f"req_{uuid.uuid4().hex}"
    result = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
              "response": {"status_code": status, "request_id": request_id, "body": answer},
              "error": None}
    return status == 200, result
