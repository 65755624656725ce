"""The server's OpenAPI document (``/openapi.json``): FastAPI's routes plus the request bodies of
the endpoints that parse their own JSON (their pydantic models' schemas), so that clients'
generators and API fuzzers see every field the server reads."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from conveyor.entrypoints.openai.anthropic import MessagesRequest
from conveyor.entrypoints.openai.batch.routes import BatchRequest
from conveyor.entrypoints.openai.lora import LoadLoRARequest, UnloadLoRARequest
from conveyor.entrypoints.openai.ollama_protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ShowBody,
)
from conveyor.entrypoints.openai.pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.entrypoints.openai.responses import ResponsesRequest

REQUEST_BODIES = {"/v1/completions": CompletionRequest,
                  "/v1/chat/completions": ChatCompletionRequest,
                  "/v1/messages": MessagesRequest,
                  "/v1/responses": ResponsesRequest,
                  "/v1/embeddings": EmbeddingRequest,
                  "/v1/score": ScoreRequest,
                  "/v1/rerank": RerankRequest,
                  "/v1/load_lora_adapter": LoadLoRARequest,
                  "/v1/unload_lora_adapter": UnloadLoRARequest,
                  "/v1/batches": BatchRequest,
                  "/api/chat": ChatBody,
                  "/api/generate": GenerateBody,
                  "/api/embed": EmbedBody,
                  "/api/embeddings": EmbeddingsBody,
                  "/api/show": ShowBody}
# Multipart bodies: the upload's fields.
UPLOAD_BODY = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}}}


def install_openapi(app: FastAPI, version: str) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas[model.__name__] = body
                doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                            f"{model.__name__}"}}}}
            doc["paths"]["/v1/files"]["post"]["requestBody"] = {"required": True, "content": {
                "multipart/form-data": {"schema": UPLOAD_BODY}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
