"""The FastAPI application: server state (engine loading in the background, draining on
shutdown), routes, and the handlers that put every error in OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.engine.args import EngineArgs
from conveyor.engine.async_engine import AsyncEngine, EngineStoppedError
from conveyor.entrypoints.openai.access_log import AccessLogMiddleware, AccessLogSettings
from conveyor.entrypoints.openai.chat import create_chat_completion
from conveyor.entrypoints.openai.completions import create_completion
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.limits import BodySizeLimitMiddleware, ServerLimits
from conveyor.entrypoints.openai.metrics import ServerMetrics
from conveyor.entrypoints.openai.playground import register_playground
from conveyor.entrypoints.openai.security import ServerSecurity, add_security

logger = logging.getLogger("conveyor.serve")


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
        logger.info("model %s loaded; max_model_len=%d; serving", self.model_names[0],
                    engine.max_model_len)

    def _build_engine(self) -> Any:
        if self.engine_factory is not None:
            return self.engine_factory(self.engine_args)
        from conveyor.engine.llm_engine import LLMEngine

        return LLMEngine(self.engine_args)

    async def close(self) -> None:
        self.draining = True
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)

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

    @property
    def tokenizer(self) -> Any:
        assert self.engine is not None
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.model_config.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)  # as LLMEngine.add_request tokenizes a text prompt

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool) -> dict[str, Any]:
        """``{"prompt", "prompt_token_ids"}`` through the model's chat template."""
        from conveyor.engine.chat import chat_prompt

        return chat_prompt(self.tokenizer, messages, add_generation_prompt)

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


def build_app(state: ServerState, security: ServerSecurity | None = None,
              limits: ServerLimits | None = None,
              access_log: AccessLogSettings | None = None) -> FastAPI:
    security = security or ServerSecurity()
    limits = limits or ServerLimits()
    access_log = access_log or AccessLogSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        yield
        state.draining = True
        if not loading.done():
            await asyncio.gather(loading, return_exceptions=True)
        await state.close()

    app = FastAPI(title="Conveyor", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.conveyor = state
    # Added innermost first: the access log sees every answer, CORS answers preflights before
    # the key check, and no unauthorized body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_bytes)
    add_security(app, security)
    if access_log.enabled:
        app.add_middleware(AccessLogMiddleware, log_prompts=access_log.log_prompts)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()[0].get('msg', 'bad input')}").response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc}").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request, limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request, limits)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = state.ready_engine()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "conveyor",
             "max_model_len": engine.max_model_len} for name in state.model_names]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return await state.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:  # still loading: ready_engine() says why
            state.ready_engine()
            raise APIError(503, "metrics are not available yet")
        body = state.metrics.render()
        if inspect.isawaitable(body):  # a fleet's metrics are gathered from its replicas
            body = await body
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    register_playground(app, state)
    return app
