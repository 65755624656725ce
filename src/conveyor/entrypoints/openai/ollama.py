"""Ollama's API on the OpenAI server's engine: ``/api/chat``, ``/api/generate``, ``/api/embed``
(and the older ``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps`` and
``/api/version``. Each generating request is translated (``ollama_protocol``) into the chat or
completion request that runs it, with the same limits, admission and engine; answers are
Ollama's JSON, streamed as newline-delimited JSON unless ``"stream": false``, and errors are
``{"error": message}`` (a line of the stream once it has started).

The server holds one model, loaded for as long as it runs: ``keep_alive`` is checked and shown
in ``/api/ps``'s ``expires_at``, and an empty ``/api/generate`` prompt answers ``done_reason``
``load`` (``unload`` with ``keep_alive`` 0) without unloading anything. Model names may carry
Ollama's ``:latest`` tag."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conveyor.core.pooling_params import PoolingParams
from conveyor.entrypoints.openai.chat import OpenAIServingChat
from conveyor.entrypoints.openai.completions import OpenAIServingCompletion
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.limits import check_sizes
from conveyor.entrypoints.openai.ollama_protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ShowBody,
    chat_request,
    expires_at,
    generate_request,
    keep_alive_seconds,
    rfc3339,
)
from conveyor.entrypoints.openai.pooling import EmbeddingRequest, OpenAIServingPooling
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningStream
from conveyor.entrypoints.openai.serving import Run, new_id
from conveyor.entrypoints.openai.sse import ndjson_response
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.limits import ServerLimits
    from conveyor.entrypoints.openai.state import ServerState
    from conveyor.entrypoints.openai.tool_parsers import ToolCall

# The Ollama API release whose shapes these routes follow (what /api/version reports: clients
# compare it against the features they need).
OLLAMA_API_VERSION = "0.12.0"
_QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d+_[A-Z0-9_]*?)|BF16|F16|F32)(?:\.gguf)?$")


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = {}
        out.append({"function": {"name": call.name, "arguments": arguments}})
    return out


class _Reply:
    """One reply as it streams: its pieces (thinking and content, tool calls held until the end
    as the chat route holds them), its finish reason and Ollama's timings."""

    def __init__(self, run: Run, tools: ToolMode | None, reasoning: Any) -> None:
        self.run = run
        self.tools = tools
        self.stream = ToolStream(tools) if tools is not None and tools.kind else None
        self.thoughts = ReasoningStream(reasoning)
        self.started = time.monotonic_ns()
        self.first: int | None = None
        self.finish_reason: str | None = None
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, content) of one engine delta."""
        if self.first is None:
            self.first = time.monotonic_ns()
        thinking, answer = self.thoughts.feed(text, finished)
        if self.stream is None:
            return thinking, answer
        pieces = self.stream.feed(answer) if answer or finished else []
        if finished:
            tail, _ = self.stream.finish()
            pieces += tail
            _, self.calls = self.tools.parse(self.stream.text)
        return thinking, "".join(p.get("content") or "" for p in pieces)

    def stats(self) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first or end
        return {"done_reason": "length" if self.finish_reason == "length" else "stop",
                "total_duration": end - self.started, "load_duration": 0,
                "prompt_eval_count": self.run.prompt_tokens,
                "prompt_eval_duration": first - self.started,
                "eval_count": self.run.output_tokens, "eval_duration": end - first}


class OllamaServing(OpenAIServingChat):
    def __init__(self, state: ServerState, limits: ServerLimits) -> None:
        super().__init__(state, limits)
        self.completion = OpenAIServingCompletion(state, limits)
        self.pooling = OpenAIServingPooling(state, limits)
        self.keep_alive_s = 300.0
        self.kept_since = time.time()

    # ------------------------------------------------------------ models
    def served(self, name: str) -> str:
        """The served model (or adapter) ``name`` means; a 404 in Ollama's words otherwise."""
        self.state.ready_engine()
        known = [*self.state.model_names, *self.state.loras]
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in known:
                return candidate
        raise APIError(404, f"model '{name}' not found")

    def _keep_alive(self, value: Any) -> float:
        seconds = keep_alive_seconds(value)
        self.keep_alive_s, self.kept_since = seconds, time.time()
        return seconds

    def _file(self) -> str | None:
        from conveyor.model.loader import model_path

        try:
            return model_path(self.state.engine_args.model)
        except ValueError:
            return None

    def _details(self) -> dict[str, Any]:
        config = self.state.engine.model_config
        path = self._file() or ""
        quant = _QUANT.search(os.path.basename(path))
        params = config.num_params
        size = (f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
                if params else "")
        return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
                "family": config.architecture, "families": [config.architecture],
                "parameter_size": size,
                "quantization_level": quant.group(1).upper() if quant else config.dtype.upper()}

    def _entry(self, name: str) -> dict[str, Any]:
        path = self._file()
        size, modified = 0, self.state.created
        if path and os.path.exists(path):
            files = ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path)
                     else [path])
            size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
            modified = int(os.path.getmtime(path))
        digest = hashlib.sha256(f"{path}:{size}:{modified}:{name}".encode()).hexdigest()
        return {"name": name, "model": name, "modified_at": rfc3339(modified), "size": size,
                "digest": digest, "details": self._details()}

    async def tags(self) -> dict[str, Any]:
        self.state.ready_engine()
        return {"models": [self._entry(n) for n in [*self.state.model_names, *self.state.loras]]}

    async def ps(self) -> dict[str, Any]:
        engine = self.state.ready_engine()
        return {"models": [{**self._entry(n), "expires_at": expires_at(self.keep_alive_s,
                                                                         self.kept_since),
                            "size_vram": 0, "context_length": engine.max_model_len}
                           for n in [*self.state.model_names, *self.state.loras]]}

    async def show(self, request: Request) -> dict[str, Any]:
        body = await self.parse(request, ShowBody)
        name = self.served(body.model or body.name or "")
        engine = self.state.engine
        config = engine.model_config
        arch = config.architecture
        template = getattr(self.state.tokenizer, "chat_template", None) or ""
        capabilities = ["completion", "tools"]
        if self.state.reasoning_parser is not None:
            capabilities.append("thinking")
        return {**{k: v for k, v in self._entry(name).items() if k in ("modified_at", "details")},
                "license": "", "modelfile": f"FROM {self._file() or name}\n",
                "parameters": "", "template": template, "capabilities": capabilities,
                "model_info": {"general.architecture": arch,
                               "general.parameter_count": config.num_params,
                               f"{arch}.context_length": engine.max_model_len,
                               f"{arch}.embedding_length": config.hidden_size,
                               f"{arch}.block_count": config.num_layers,
                               f"{arch}.attention.head_count": config.num_heads,
                               f"{arch}.attention.head_count_kv": config.num_kv_heads,
                               f"{arch}.vocab_size": config.vocab_size}}

    # ------------------------------------------------------------ generating
    async def chat(self, request: Request) -> Response:
        body = await self.parse(request, ChatBody)
        model = self.served(body.model)
        self._keep_alive(body.keep_alive)
        self._check_think(body.think)
        req = chat_request(body, model)
        run, tools = await self.start_chat(request, req, "ollama-chat")
        return await self._answer(request, run, tools, body, model, chat=True)

    async def generate(self, request: Request) -> Response:
        body = await self.parse(request, GenerateBody)
        model = self.served(body.model)
        keep_alive = self._keep_alive(body.keep_alive)
        self._check_think(body.think)
        if not body.prompt and not body.raw:  # Ollama's "load the model" call
            return JSONResponse({"model": body.model, "created_at": rfc3339(time.time()),
                                 "response": "", "done": True,
                                 "done_reason": "unload" if keep_alive == 0 else "load"})
        req = generate_request(body, model)
        if isinstance(req, ChatCompletionRequest):
            run, tools = await self.start_chat(request, req, "ollama-gen")
            return await self._answer(request, run, tools, body, model, chat=False)
        check_sizes(req, self.limits)
        self.check_request(req.model)
        request_id = new_id("ollama-gen")
        run = await self.admit(request, request_id, 1, 1,
                               partial(self.completion._jobs, request, req, request_id))
        return await self._answer(request, run, None, body, model, chat=False)

    def _check_think(self, think: bool | str | None) -> None:
        if think and self.state.reasoning_parser is None:
            raise APIError(400, f"\"{self.state.model_names[0]}\" does not support thinking "
                           "(start the server with --reasoning-parser)")

    async def _answer(self, request: Request, run: Run, tools: ToolMode | None,
                      body: ChatBody | GenerateBody, model: str, chat: bool) -> Response:
        reply = _Reply(run, tools, self.state.reasoning_parser)
        think = bool(body.think)
        name = body.model

        def piece(thinking: str, text: str, calls: list[ToolCall] | None = None
                  ) -> dict[str, Any]:
            out: dict[str, Any] = {"model": name, "created_at": rfc3339(time.time())}
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if think and thinking:
                    message["thinking"] = thinking
                if calls:
                    message["tool_calls"] = _tool_calls(calls)
                out["message"] = message
            else:
                out["response"] = text
                if think and thinking:
                    out["thinking"] = thinking
            return out

        async def deltas() -> AsyncIterator[tuple[str, str]]:
            async with aclosing(self.outputs(run)) as outputs:
                async for _, d in outputs:
                    for c in d.outputs:
                        if c.finish_reason is not None:
                            reply.finish_reason = c.finish_reason
                        yield reply.feed(c.text, c.finish_reason is not None)

        if body.stream:
            async def lines() -> AsyncIterator[str]:
                try:
                    async with aclosing(deltas()) as parts:
                        async for thinking, text in parts:
                            if (think and thinking) or text:
                                yield _line({**piece(thinking, text), "done": False})
                except Exception as e:
                    yield _line({"error": self.state.api_error(e).message})
                    return
                if reply.calls:
                    yield _line({**piece("", "", reply.calls), "done": False})
                yield _line({**piece("", ""), "done": True, **reply.stats()})

            return ndjson_response(lines(), on_close=run.reservation.release)

        async def whole() -> Response:
            thinking, text = [], []
            async with aclosing(deltas()) as parts:
                async for t, c in parts:
                    thinking.append(t)
                    text.append(c)
            out = piece("".join(thinking), "".join(text), reply.calls)
            return JSONResponse({**out, "done": True, **reply.stats()})

        return await self.full_response(request, run, whole())

    # ------------------------------------------------------------ embeddings
    async def embed(self, request: Request, legacy: bool = False) -> Response:
        body = await self.parse(request, EmbeddingsBody if legacy else EmbedBody)
        model = self.served(body.model)
        self._keep_alive(body.keep_alive)
        started = time.monotonic_ns()
        texts = [body.prompt] if legacy else (
            [body.input] if isinstance(body.input, str) else body.input)
        if not legacy and body.truncate:
            limit = self.state.engine.max_model_len
            texts = await self.state.off_loop(
                lambda: [ids[:limit] for ids in (self.state.encode(t) for t in texts)])
        req = EmbeddingRequest(model=model, input="")
        params = PoolingParams(normalize=True,
                               dimensions=None if legacy else body.dimensions)

        def render(vectors: list[list[float]], prompt_tokens: int) -> Response:
            if legacy:
                return JSONResponse({"embedding": vectors[0]})
            return JSONResponse({"model": body.model, "embeddings": vectors,
                                 "total_duration": time.monotonic_ns() - started,
                                 "load_duration": 0, "prompt_eval_count": prompt_tokens})

        return await self.pooling._pool(request, req, texts, "input", params, "ollama-embd",
                                        render)


def register_ollama(app: FastAPI, state: ServerState, limits: ServerLimits) -> None:
    """Ollama's routes on ``app``."""
    serving = OllamaServing(state, limits)

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        return await serving.chat(request)

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        return await serving.generate(request)

    @app.post("/api/embed")
    async def ollama_embed(request: Request) -> Response:
        return await serving.embed(request)

    @app.post("/api/embeddings")
    async def ollama_embeddings(request: Request) -> Response:
        return await serving.embed(request, legacy=True)

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return await serving.tags()

    @app.post("/api/show")
    async def ollama_show(request: Request) -> dict[str, Any]:
        return await serving.show(request)

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        return await serving.ps()

    @app.get("/api/version")
    async def ollama_version() -> dict[str, Any]:
        return {"version": OLLAMA_API_VERSION, "conveyor": version("conveyor")}
