"""ServerState: what the OpenAI handlers share — the engine (loaded in the background), its
metrics, the admission counter, the worker threads that parse and tokenize request bodies off
the event loop, and the draining flag set on shutdown. Imports none of the handlers, so they and
the app can all import it."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from conveyor.engine.args import EngineArgs
from conveyor.engine.async_engine import AsyncEngine, EngineStoppedError
from conveyor.entrypoints.openai.admission import SequenceAdmission
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.limits import ListLimits
from conveyor.entrypoints.openai.metrics import ServerMetrics
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningParser
from conveyor.entrypoints.openai.server_paths import ClientPaths
from conveyor.lora.request import LoRARequest

logger = logging.getLogger("conveyor.serve")

T = TypeVar("T")
# Threads that parse, render and tokenize request bodies: the tokenizer releases the GIL, so a
# megabyte prompt holds up neither the event loop (streams, /health) nor the engine thread; they
# run at a lower CPU priority so that on a busy machine those two win the cores.
PREPROCESS_THREADS = 2
PREPROCESS_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPROCESS_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class ServerState:
    """Everything the handlers share. ``engine`` is None until the model has loaded."""

    def __init__(self, engine_args: EngineArgs, served_model_name: str | None = None,
                 max_queued_requests: int | None = None,
                 engine_factory: Callable[[EngineArgs], Any] | None = None) -> None:
        self.engine_args = engine_args
        self.engine_factory = engine_factory  # None: LLMEngine
        self.served_model_name = served_model_name
        self.max_queued_requests = max_queued_requests
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.created = int(time.time())
        self.on_fatal: Callable[[], None] = lambda: None
        self.admission = SequenceAdmission()  # build_app sets the configured limit
        self.reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
        self.tool_call_parser: str | None = None  # --tool-call-parser (None: the template's)
        self.batch_dir: Path | None = None  # --batch-dir: files and batch jobs (None: cache's)
        self.lora_modules: dict[str, str] = {}  # --lora-modules: loaded with the model
        self.allow_runtime_lora = False  # --allow-runtime-lora: the load/unload routes work
        self.lora_paths = ClientPaths()  # --lora-root: where those loads may read
        self.loras: dict[str, LoRARequest] = {}  # adapters served, by the name clients send
        self._adding_loras: set[str] = set()  # names whose adapter is being read
        self._lora_ids = itertools.count(1)
        self._preprocess = ThreadPoolExecutor(PREPROCESS_THREADS,
                                              thread_name_prefix="conveyor-preprocess",
                                              initializer=_lower_priority)

    # ------------------------------------------------------------ lifecycle
    async def load(self) -> None:
        try:
            engine = await asyncio.to_thread(self._build_engine)
        except Exception as e:
            if isinstance(e, ValueError):  # a bad flag or model path: the message says it all
                logger.error("cannot start the engine: %s", e)
            else:
                logger.exception("failed to load the engine")
            self.load_error = e
            self.on_fatal()
            return
        metrics = ServerMetrics(self._model_name(engine))
        async_engine = AsyncEngine(engine, observers=[metrics.observe],
                                   on_dead=lambda _e: self.on_fatal())
        metrics.attach(async_engine)
        async_engine.start(asyncio.get_running_loop())
        self.metrics, self.engine = metrics, async_engine
        if not await self.load_lora_modules():
            return
        logger.info("model %s loaded; max_model_len=%d; serving", self.model_names[0],
                    engine.max_model_len)

    async def load_lora_modules(self) -> bool:
        """Serve the ``--lora-modules`` adapters; False (the server stops) if one fails."""
        for name, path in self.lora_modules.items():
            try:
                await self.add_lora(name, path)
            except (ValueError, APIError) as e:
                logger.error("cannot load LoRA adapter %r: %s", name, e)
                self.load_error = e
                self.on_fatal()
                return False
        return True

    def _build_engine(self) -> Any:
        if self.engine_factory is not None:
            return self.engine_factory(self.engine_args)
        from conveyor.engine.llm_engine import LLMEngine

        return LLMEngine(self.engine_args)

    async def close(self) -> None:
        self.draining = True
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a preprocessing thread (parsing, chat templates, tokenizing)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._preprocess, functools.partial(fn, *args))

    def _model_name(self, engine: Any) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.engine_args.model or engine.model_config.name

    # ------------------------------------------------------------ helpers for handlers
    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if self.load_error is not None:
            raise APIError(503, f"The model failed to load: {self.load_error}", code="load_failed")
        if self.engine is None:
            raise APIError(503, "The server is starting: the model is still loading.",
                           code="starting")
        if self.engine.error is not None:
            raise APIError(503, f"The engine stopped: {self.engine.error}", code="engine_dead")
        return self.engine

    @property
    def model_names(self) -> list[str]:
        assert self.engine is not None
        return [self._model_name(self.engine.engine)]

    def check_lora_name(self, name: str) -> None:
        """ValueError unless this server serves adapters and ``name`` is free."""
        if not self.engine_args.enable_lora:
            raise ValueError("this server does not serve LoRA adapters: start it with "
                             "--enable-lora")
        if name in self.loras or name in self._adding_loras or name in self.model_names:
            raise ValueError(f"the name {name!r} is already served")

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``: ValueError for a bad adapter, a name
        already taken, or a server without --enable-lora."""
        self.check_lora_name(name)
        lora = LoRARequest(name, next(self._lora_ids), path)
        self._adding_loras.add(name)  # a second load of the name while this one reads fails
        try:
            await self.ready_engine().add_lora(lora)
        finally:
            self._adding_loras.discard(name)
        self.loras[name] = lora
        return lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.loras.get(model) if model is not None else None

    @property
    def tokenizer(self) -> Any:
        assert self.engine is not None
        return self.engine.tokenizer

    def list_limits(self) -> ListLimits | None:
        """The loaded model's bounds on a request's lists (None while it loads)."""
        if self.engine is None:
            return None
        return ListLimits(self.engine.max_model_len, self.engine.model_config.vocab_size)

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.model_config.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)  # as LLMEngine.add_request tokenizes a text prompt

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``{"prompt", "prompt_token_ids"}`` through the model's chat template."""
        from conveyor.engine.chat import chat_prompt

        return chat_prompt(self.tokenizer, messages, add_generation_prompt, tools)

    async def health(self) -> dict[str, Any]:
        """The /health body; raises APIError (503) when not ready."""
        self.ready_engine()
        return {"status": "ok"}

    @staticmethod
    def api_error(e: BaseException) -> APIError:
        """An exception raised while generating -> the error the client sees."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, EngineStoppedError):
            return APIError(503, str(e), code="shutting_down")
        if isinstance(e, ValueError):
            return APIError(400, str(e))
        logger.error("request failed: %r", e)
        return APIError(500, f"internal error: {e}")
