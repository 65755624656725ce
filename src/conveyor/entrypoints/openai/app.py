"""The FastAPI application over a ServerState (``state``): its lifespan (load the engine in the
background, drain on shutdown), middleware, routes, and the handlers that put every error in
OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.entrypoints.openai.access_log import AccessLogMiddleware, AccessLogSettings
from conveyor.entrypoints.openai.admission import SequenceAdmission
from conveyor.entrypoints.openai.anthropic import AnthropicServingMessages
from conveyor.entrypoints.openai.batch.routes import register_batches
from conveyor.entrypoints.openai.chat import OpenAIServingChat
from conveyor.entrypoints.openai.completions import OpenAIServingCompletion
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.limits import (
    BodySizeLimitMiddleware,
    JSONContentTypeMiddleware,
    ServerLimits,
)
from conveyor.entrypoints.openai.lora import load_lora_adapter, unload_lora_adapter
from conveyor.entrypoints.openai.ollama import register_ollama
from conveyor.entrypoints.openai.openapi import install_openapi
from conveyor.entrypoints.openai.playground import register_playground
from conveyor.entrypoints.openai.pooling import OpenAIServingPooling
from conveyor.entrypoints.openai.responses import OpenAIServingResponses
from conveyor.entrypoints.openai.security import ServerSecurity, add_security
from conveyor.entrypoints.openai.state import ServerState

logger = logging.getLogger("conveyor.serve")


def build_app(state: ServerState, security: ServerSecurity | None = None,
              limits: ServerLimits | None = None,
              access_log: AccessLogSettings | None = None) -> FastAPI:
    security = security or ServerSecurity()
    limits = limits or ServerLimits()
    access_log = access_log or AccessLogSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        batches.start()  # resume the batch jobs a previous run left unfinished
        yield
        state.draining = True
        await batches.stop()
        if not loading.done():
            await asyncio.gather(loading, return_exceptions=True)
        await state.close()

    app = FastAPI(title="Conveyor", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.conveyor = state
    state.admission = SequenceAdmission(limits.max_sequences_in_flight)
    # Added innermost first: the access log sees every answer, CORS answers preflights before
    # the key check, and no unauthorized body is read (an oversized one is 413 before 415).
    app.add_middleware(JSONContentTypeMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_bytes)
    add_security(app, security)
    if access_log.enabled:
        app.add_middleware(AccessLogMiddleware, log_prompts=access_log.log_prompts)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()[0].get('msg', 'bad input')}"
                        ).response(request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc}").response(request.url.path)

    serving_completion = OpenAIServingCompletion(state, limits)
    serving_chat = OpenAIServingChat(state, limits)
    serving_messages = AnthropicServingMessages(state, limits)
    serving_responses = OpenAIServingResponses(state, limits)
    serving_pooling = OpenAIServingPooling(state, limits)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving_completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving_chat.create_chat_completion(request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serving_messages.create_message(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serving_responses.create_response(request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serving_pooling.create_embedding(request)

    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        return await serving_pooling.create_score(request)

    @app.post("/v1/rerank")
    async def rerank(request: Request) -> Response:
        return await serving_pooling.create_rerank(request)

    app.add_api_route("/rerank", rerank, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v2/rerank", rerank, methods=["POST"], include_in_schema=False)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        return await load_lora_adapter(state, request, limits)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        return await unload_lora_adapter(state, request, limits)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = state.ready_engine()
        base = [{"id": name, "object": "model", "created": state.created, "owned_by": "conveyor",
                 "root": name, "parent": None, "max_model_len": engine.max_model_len}
                for name in state.model_names]
        adapters = [{"id": name, "object": "model", "created": state.created,
                     "owned_by": "conveyor", "root": lora.lora_path,
                     "parent": state.model_names[0], "max_model_len": engine.max_model_len}
                    for name, lora in state.loras.items()]
        return {"object": "list", "data": base + adapters}

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

    register_ollama(app, state, limits)
    batches = register_batches(app, state, limits, state.batch_dir)
    register_playground(app, state)
    install_openapi(app, version("conveyor"))
    return app
