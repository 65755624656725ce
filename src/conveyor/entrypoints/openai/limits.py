"""How much one request may ask of the server: the body's media type and size (both enforced
before anything reads the body), the JSON nesting depth, the number and length of stop strings,
the length of short string fields, the number of prompts and of tools, ``n``, and the sequences
in flight (``admission``). Each violation is a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.unicode_text import INVALID_UNICODE_MODES

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # --max-request-bytes
    max_json_depth: int = 32
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    max_name_chars: int = 1024  # model, user, a message's name
    max_prompts: int = 1024  # --max-prompts-per-request: prompts in one /v1/completions request
    max_n: int = 128  # --max-n: samples per prompt
    max_sequences_in_flight: int | None = 1024  # --max-sequences-in-flight (None: no limit)
    max_tools: int = 128  # --max-tools: tools in one chat request
    invalid_unicode: str = "reject"  # --invalid-unicode: or "replace" (unicode_text.py)

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts", "max_n", "max_sequences_in_flight",
                     "max_tools"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.invalid_unicode not in INVALID_UNICODE_MODES:
            raise ValueError(f"--invalid-unicode must be reject or replace, got "
                             f"{self.invalid_unicode!r}")


@dataclass(frozen=True)
class ListLimits:
    """The model's bounds on a request's long lists, checked on the parsed JSON before anything
    walks them: a token-id prompt (or all messages) cannot exceed the context, ``logit_bias``
    and ``stop_token_ids`` cannot name more tokens than the vocabulary has."""

    max_model_len: int
    vocab_size: int


class JSONContentTypeMiddleware:
    """415 for a POST to ``/v1/*`` whose Content-Type is not ``application/json``: a browser
    may send a cross-origin "simple" request (text/plain, form data) without a preflight, and
    such a body must not run. File uploads (``/v1/files``) are multipart and run nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].startswith("/v1/") and scope["path"] != "/v1/files"):
            media_type = _header(scope, b"content-type") or b""
            media_type = media_type.split(b";", 1)[0].strip().lower()
            if media_type != b"application/json":
                shown = media_type.decode("latin-1") or "none"
                err = APIError(415, f"The request body must be JSON sent as 'Content-Type: "
                               f"application/json' (got {shown}).",
                               code="unsupported_media_type")
                await err.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 for a body over ``max_bytes``: at once when Content-Length says so, otherwise as soon
    as the chunks received so far add up to more (a chunked upload has no Content-Length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than the server's limit of "
                        f"{self.max_bytes} bytes (--max-request-bytes).",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large().response(scope["path"])(scope, receive, send)
            return
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if response_started:
                raise
            await self._too_large().response(scope["path"])(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None  # the HTTP server itself rejects a malformed Content-Length


def check_list_sizes(body: dict[str, Any], limits: ServerLimits,
                     lists: ListLimits | None) -> None:
    """The lengths of a parsed body's long lists (prompts, tools, token ids, messages,
    logit_bias, stop_token_ids), each a constant-time check, so that validating what passes takes time in
    proportion to what the model can use."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > limits.max_prompts:
            raise bad_request(f"'prompt' has {len(prompt)} prompts; at most "
                              f"{limits.max_prompts} are allowed in one request "
                              "(--max-prompts-per-request)", param="prompt",
                              code="too_many_prompts")
    tools = body.get("tools")  # chat, Messages and Responses requests
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise bad_request(f"'tools' has {len(tools)} tools; at most {limits.max_tools} are "
                          "allowed in one request (--max-tools)", param="tools",
                          code="too_many_tools")
    if lists is None:
        return
    token_lists = [prompt] if isinstance(prompt, list) and prompt \
        and isinstance(prompt[0], int) else prompt if isinstance(prompt, list) else []
    for ids in token_lists:
        if isinstance(ids, list) and len(ids) > lists.max_model_len:
            raise bad_request(f"a 'prompt' of {len(ids)} token ids is longer than the model's "
                              f"context of {lists.max_model_len} tokens (--max-model-len)",
                              param="prompt", code="context_length_exceeded")
    for field in ("messages", "input"):  # chat / Messages turns, Responses items
        turns = body.get(field)
        if (isinstance(turns, list) and len(turns) > lists.max_model_len
                and (field == "messages" or isinstance(turns[0], dict))):
            raise bad_request(f"'{field}' has {len(turns)} items, more than the model's "
                              f"context of {lists.max_model_len} tokens can hold "
                              "(--max-model-len)", param=field, code="context_length_exceeded")
    for field in ("logit_bias", "stop_token_ids"):
        value = body.get(field)
        if isinstance(value, (list, dict)) and len(value) > lists.vocab_size:
            raise bad_request(f"'{field}' has {len(value)} entries; the vocabulary has "
                              f"{lists.vocab_size} tokens", param=field)


def check_sizes(req: Any, limits: ServerLimits) -> None:
    """Stop strings, short string fields and ``n`` of a validated request within ``limits``."""
    if req.n > limits.max_n:
        raise bad_request(f"'n' is {req.n}; at most {limits.max_n} samples per prompt are "
                          "allowed (--max-n)", param="n", code="n_too_large")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_sequences:
        raise bad_request(f"'stop' has {len(stop)} sequences; at most "
                          f"{limits.max_stop_sequences} are allowed", param="stop")
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"a 'stop' sequence has {len(s)} characters; at most "
                              f"{limits.max_stop_chars} are allowed", param="stop")
    named = [("model", req.model), ("user", req.user)]
    named += [("messages", m.name) for m in getattr(req, "messages", [])]
    for field, value in named:
        if value is not None and len(value) > limits.max_name_chars:
            what = "a message's 'name'" if field == "messages" else f"'{field}'"
            raise bad_request(f"{what} has {len(value)} characters; at most "
                              f"{limits.max_name_chars} are allowed", param=field)
