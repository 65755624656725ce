"""Who may call the server: API keys (``Authorization: Bearer <key>`` on every ``/v1`` and Ollama
``/api`` route and, optionally, ``/metrics``) and CORS for browser pages on other origins (closed by default)."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor.entrypoints.openai.errors import APIError

API_KEY_ENV = "CONVEYOR_API_KEY"


@dataclass(frozen=True)
class ServerSecurity:
    """Access settings of one server. ``api_keys`` empty: no key required."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never printed
    metrics_require_key: bool = False
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


def load_api_keys(keys: Iterable[str] = (), key_file: str | Path | None = None,
                  environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys from ``--api-key`` flags, an ``--api-key-file`` (one a line, ``#`` comments)
    and ``$CONVEYOR_API_KEY``, without duplicates. Raises ValueError for an empty key."""
    found = [k.strip() for k in keys]
    if any(not k for k in found):
        raise ValueError("--api-key must not be empty")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file {key_file}: {e.strerror}") from e
        file_keys = [line.strip() for line in lines]
        file_keys = [k for k in file_keys if k and not k.startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file {key_file} holds no key")
        found += file_keys
    env_key = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    if env_key:
        found.append(env_key)
    return tuple(dict.fromkeys(found))


class APIKeyMiddleware:
    """Answers 401 (OpenAI's error body) to a protected request without a valid bearer key.

    The presented key is compared with every configured key, always all of them, as SHA-256
    digests: the time taken depends neither on which key matched nor on a key's length.
    """

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], metrics_require_key: bool) -> None:
        self.app = app
        self._digests = [_digest(k) for k in api_keys]
        self._metrics_require_key = metrics_require_key

    def _protected(self, path: str) -> bool:
        if path in ("/v1", "/api") or path.startswith(("/v1/", "/api/")):
            return True
        return self._metrics_require_key and path == "/metrics"

    def _authorized(self, scope: Scope) -> bool:
        token = _bearer_token(scope)
        if token is None:
            return False
        presented = hashlib.sha256(token).digest()
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self._protected(scope["path"])
                or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Invalid or missing API key: send it as the header "
                       "'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                       code="invalid_api_key")
        response = err.response(scope["path"])
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _bearer_token(scope: Scope) -> bytes | None:
    """The key of the Authorization header (or of Anthropic's ``x-api-key``), as the bytes sent
    (UTF-8 for a non-ASCII key)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    for name, value in scope["headers"]:
        if name == b"x-api-key" and value.strip():
            return value.strip()
    return None


def add_security(app: FastAPI, security: ServerSecurity) -> None:
    """Install the key check and, outside it, CORS (a preflight carries no key)."""
    if security.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=security.api_keys,
                           metrics_require_key=security.metrics_require_key)
    if security.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(security.allowed_origins),
                           allow_methods=list(security.allowed_methods),
                           allow_headers=list(security.allowed_headers))
