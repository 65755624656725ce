"""Ollama's request bodies and their translation into the OpenAI requests that run them: a chat
(``/api/chat``, and ``/api/generate`` through the chat template) becomes a chat completion
request, a raw ``/api/generate`` a completion request. ``options`` map to sampling parameters
(``num_predict`` -> ``max_tokens``, ``repeat_penalty`` -> ``repetition_penalty``; options absent
keep the engine's defaults, as the OpenAI routes do; load-time options such as ``num_ctx`` are
accepted and ignored), ``format`` to a structured-outputs constraint (``"json"``: any JSON
object; a JSON schema: that schema)."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from conveyor.entrypoints.openai.errors import bad_request, from_validation_error
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.entrypoints.openai.request_model import RequestModel


class _Lenient(RequestModel):
    """An Ollama request body (or an object in one). Ollama's server ignores fields it does not
    know (Go's JSON decoding drops them), and its clients send fields of newer versions, so
    these models ignore unknown fields rather than refuse them; everything else of
    ``RequestModel`` holds (strict types), and the bodies are parsed as every route's are
    (``serving.parse_body``: strict JSON without ``NaN``/``Infinity``, bounded lists and
    nesting, and a lone UTF-16 surrogate anywhere a 400 naming its field)."""

    model_config = ConfigDict(extra="ignore")


class Options(_Lenient):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1: no limit, -2: fill the context
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None


class OllamaMessage(_Lenient):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generating(_Lenient):
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None
    think: bool | str | None = None


class ChatBody(_Generating):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Generating):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedBody(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None


class EmbeddingsBody(_Lenient):
    """The older ``/api/embeddings``: one prompt, one vector."""

    model: str = Field(min_length=1)
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None


class ShowBody(_Lenient):
    model: str | None = None
    name: str | None = None  # the field's older name
    verbose: bool = False


def _options(raw: dict[str, Any] | None) -> Options:
    try:
        return Options.model_validate(raw or {})
    except ValidationError as e:
        err = from_validation_error(e)
        raise bad_request(f"options: {err.message}", param="options") from e


def _sampling(options: dict[str, Any] | None, fmt: str | dict[str, Any] | None
              ) -> dict[str, Any]:
    """The OpenAI request fields of ``options`` and ``format`` (None where absent)."""
    o = _options(options)
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    body: dict[str, Any] = {
        "temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "min_p": o.min_p,
        "seed": o.seed, "max_tokens": max_tokens, "stop": o.stop,
        "presence_penalty": o.presence_penalty, "frequency_penalty": o.frequency_penalty,
        "repetition_penalty": o.repeat_penalty}
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("'format' must be \"json\" or a JSON schema object", param="format")
    return body


def _validated(cls: type[Any], body: dict[str, Any]) -> Any:
    try:  # None: the field's default, except max_tokens (Ollama's default is no limit)
        return cls.model_validate({k: v for k, v in body.items()
                                   if v is not None or k == "max_tokens"})
    except ValidationError as e:
        raise from_validation_error(e) from e


def _no_images(images: list[str] | None, where: str) -> None:
    if images:
        raise bad_request(f"{where}: images are not supported by this model", param=where)


def _chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        _no_images(m.images, f"messages.{i}.images")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for k, call in enumerate(m.tool_calls):
                fn = call.get("function") or {}
                if not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages.{i}.tool_calls.{k}: a call needs a function "
                                      "name", param="messages")
                arguments = fn.get("arguments", {})
                calls.append({"id": f"call_{i}_{k}", "type": "function", "function": {
                    "name": fn["name"], "arguments": arguments if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False)}})
            message["tool_calls"] = calls
        if m.role == "tool" and m.tool_name:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": t.get("type") or "function", "function": t.get("function")} for t in tools]


def chat_request(body: ChatBody, model: str) -> ChatCompletionRequest:
    """The chat completion request that runs an ``/api/chat`` body."""
    if not body.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    return _validated(ChatCompletionRequest, {
        "model": model, "messages": _chat_messages(body.messages), "tools": _tools(body.tools),
        "stream": body.stream, **_sampling(body.options, body.format)})


def generate_request(body: GenerateBody, model: str
                     ) -> ChatCompletionRequest | CompletionRequest:
    """The request that runs an ``/api/generate`` body: a chat of its system and prompt through
    the model's template, or (``raw``) a completion of the prompt as it is."""
    _no_images(body.images, "images")
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise bad_request(f"'{name}' is not supported", param=name)
    if body.context:
        raise bad_request("'context' is not supported: send the conversation to /api/chat",
                          param="context")
    sampling = {"model": model, "stream": body.stream, **_sampling(body.options, body.format)}
    if body.raw:
        return _validated(CompletionRequest, {"prompt": body.prompt, **sampling})
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt})
    return _validated(ChatCompletionRequest, {"messages": messages, **sampling})


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER_S = 100 * 365 * 86400.0  # what a negative (or longer) keep_alive shows as


def keep_alive_seconds(value: float | int | str | None) -> float:
    """``keep_alive`` in seconds (a number of seconds, or a duration such as ``"5m"`` or
    ``"1h30m"``; negative: forever); a 400 for anything else."""
    if value is None:
        return DEFAULT_KEEP_ALIVE_S
    bad = bad_request(f"'keep_alive' must be a duration such as \"5m\" or a number of "
                      f"seconds, got {value!r}", param="keep_alive")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        parts = _DURATION.findall(text)
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = sign * float(text)
        elif parts and "".join(n + u for n, u in parts) == text:
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
        else:
            raise bad
    if not math.isfinite(seconds):
        raise bad
    return seconds


def expires_at(keep_alive_s: float, since: float | None = None) -> str:
    """When a model kept alive ``keep_alive_s`` from ``since`` would be unloaded (RFC 3339)."""
    since = time.time() if since is None else since
    return rfc3339(since + (min(keep_alive_s, FOREVER_S) if keep_alive_s >= 0 else FOREVER_S))


def rfc3339(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + \
        f".{int(seconds % 1 * 1e6):06d}Z"
