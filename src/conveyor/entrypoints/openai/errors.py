"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}`` (on
Anthropic's path its shape, on Ollama's ``{"error": message}``).

Handlers raise ``APIError``; the app turns it (and any FastAPI/Starlette error, so that
FastAPI's raw 422 dump never leaks) into that shape.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

ANTHROPIC_PATH = "/v1/messages"  # errors there take Anthropic's shape
OLLAMA_PATH = "/api/"  # and there Ollama's, {"error": message}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return {401: "authentication_error", 404: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's Messages API shape."""
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error's response; in Anthropic's shape on its API's paths (``path``)."""
        if path.startswith(OLLAMA_PATH):
            return JSONResponse({"error": self.message}, status_code=self.status,
                                headers=self.headers)
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH) else self.body()
        return _ErrorResponse(body, status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """JSON in ASCII: whatever text an error message quotes (a lone surrogate included), its
    answer renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation_error(err: ValidationError) -> APIError:
    """One readable 400 from pydantic's error list, naming the offending field."""
    errors = err.errors(include_url=False)
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required field", param)
    if first["type"] == "extra_forbidden":
        where = ".".join(str(p) for p in first["loc"])
        return bad_request(f"Unrecognized request argument supplied: '{where}' is not a field "
                           "of this API", param, code="unknown_field")
    # A union (prompt, stop, content, ...) fails once per alternative, each location ending in
    # the alternative's type; the field is where those locations agree.
    same_field = [tuple(e["loc"]) for e in errors if e["loc"][:1] == first["loc"][:1]]
    path = same_field[0]
    for loc in same_field[1:]:
        n = 0
        while n < min(len(path), len(loc)) and path[n] == loc[n]:
            n += 1
        path = path[:n]
    where = ".".join(str(p) for p in path)
    if len(same_field) > 1:
        return bad_request(f"'{where}' has an invalid type or value ({first['msg']})", param)
    return bad_request(f"'{where}': {first['msg']}", param)
