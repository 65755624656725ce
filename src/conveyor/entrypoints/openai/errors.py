"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; the app turns it (and any FastAPI/Starlette error, so that
FastAPI's raw 422 dump never leaks) into that shape.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation_error(err: ValidationError) -> APIError:
    """One readable 400 from pydantic's error list, naming the offending field."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    if first["type"] == "missing":
        return bad_request(f"'{param}' is a required field", param)
    if len(same_field) > 1:  # a union: pydantic reports one failure per alternative
        return bad_request(f"'{param}' has an invalid type or value ({first['msg']})", param)
    where = ".".join(p for p in loc if not p.startswith(("list[", "dict[")) and p != "str")
    return bad_request(f"'{where}': {first['msg']}", param)
