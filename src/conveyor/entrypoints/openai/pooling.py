"""The pooling endpoints: ``POST /v1/embeddings`` (OpenAI's shape), ``POST /v1/score`` (vLLM's)
and ``POST /v1/rerank`` (Jina's / Cohere's, also at ``/rerank`` and ``/v2/rerank``).

Each text becomes one pooling request of the engine (``PoolingParams``), admitted, limited and
aborted like a completion's prompt; score and rerank compare the vectors by cosine similarity
(``engine/scoring.py``). The answer is made on a preprocessing thread, not the event loop, and
a long list of vectors is encoded one vector at a time (``_json_array``): one ``json.dumps`` of
2,000 vectors would hold the GIL, and so the engine thread and every stream, for seconds.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from conveyor.core.pooling_params import PoolingParams
from conveyor.engine.scoring import pair_scores, score_inputs
from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.serving import Job, OpenAIServing, Run, new_id, now_s

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine

# The vectors of a request's texts, in order, and the prompt tokens they took -> the answer.
Render = Callable[[list[list[float]], int], Response]


class _Request(RequestModel):
    model: str | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)
    priority: int = 0


class EmbeddingRequest(_Request):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None  # vLLM's extra: None keeps the model's choice


class ScoreRequest(_Request):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Request):
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True


Texts = list[str] | list[list[int]]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # what OpenAI's client asks for: little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _json_array(items: list[Any]) -> str:
    """``items`` as a JSON array, one ``json.dumps`` call per item (the GIL is free between)."""
    return "[" + ",".join(_dumps(item) for item in items) + "]"


class OpenAIServingPooling(OpenAIServing):
    async def create_embedding(self, request: Request) -> Response:
        req = await self.parse(request, EmbeddingRequest)
        texts: Texts = [req.input] if isinstance(req.input, str) else req.input
        if texts and isinstance(texts[0], int):
            texts = [texts]  # one prompt as token ids
        # the engine resolves these against the model's pooling (a 400 for dimensions it lacks)
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)

        def render(vectors: list[list[float]], prompt_tokens: int) -> Response:
            data = _json_array([{"object": "embedding", "index": i,
                                 "embedding": _encode(v, req.encoding_format)}
                                for i, v in enumerate(vectors)])
            rest = _dumps({"model": self.model_name(req.model),
                           "usage": {"prompt_tokens": prompt_tokens,
                                     "total_tokens": prompt_tokens}})
            return Response('{"object":"list","data":' + data + "," + rest[1:],
                            media_type="application/json")

        return await self._pool(request, req, texts, "input", params, "embd", render)

    async def create_score(self, request: Request) -> Response:
        req = await self.parse(request, ScoreRequest)
        try:
            texts, pairs = score_inputs(req.text_1, req.text_2)
        except ValueError as e:
            raise bad_request(str(e), param="text_2") from e

        def render(vectors: list[list[float]], prompt_tokens: int) -> Response:
            scores = pair_scores(vectors, pairs)
            return JSONResponse({"id": new_id("score"), "object": "list", "created": now_s(),
                                 "model": self.model_name(req.model),
                                 "data": [{"index": k, "object": "score", "score": s}
                                          for k, s in enumerate(scores)],
                                 "usage": {"prompt_tokens": prompt_tokens,
                                           "total_tokens": prompt_tokens}})

        return await self._pool(request, req, texts, "text_1", PoolingParams(), "score", render)

    async def create_rerank(self, request: Request) -> Response:
        req = await self.parse(request, RerankRequest)
        if not req.documents:
            raise bad_request("'documents' must hold at least one document", param="documents")
        texts, pairs = score_inputs(req.query, req.documents)

        def render(vectors: list[list[float]], prompt_tokens: int) -> Response:
            scores = pair_scores(vectors, pairs)
            order = sorted(range(len(scores)), key=lambda k: -scores[k])
            if req.top_n:
                order = order[:req.top_n]
            results = []
            for k in order:
                result: dict[str, Any] = {"index": k, "relevance_score": scores[k]}
                if req.return_documents:
                    result["document"] = {"text": req.documents[k]}
                results.append(result)
            return JSONResponse({"id": new_id("rerank"), "model": self.model_name(req.model),
                                 "usage": {"total_tokens": prompt_tokens}, "results": results})

        return await self._pool(request, req, texts, "documents", PoolingParams(), "rerank",
                                render)

    async def _pool(self, request: Request, req: _Request, texts: Texts, param: str,
                    params: PoolingParams, kind: str, render: Render) -> Response:
        """One pooling request per text, admitted and run; ``render`` makes the answer."""
        self.check_request(req.model, req.priority)
        max_prompts = self.limits.max_prompts
        if len(texts) > max_prompts:
            raise bad_request(f"'{param}' has {len(texts)} inputs; at most {max_prompts} are "
                              "allowed in one request (--max-prompts-per-request)", param=param,
                              code="too_many_prompts")
        request_id = new_id(kind)
        run = await self.admit(request, request_id, len(texts), len(texts),
                               partial(self._jobs, req, texts, param, params, request_id))
        return await self.full_response(request, run, self._vectors(run, render))

    async def _jobs(self, req: _Request, texts: Texts, param: str, params: PoolingParams,
                    request_id: str, engine: AsyncEngine) -> list[Job]:
        prompts = await self.state.off_loop(self._prompts, texts, param)
        lora = self.state.lora_request(req.model)
        return [Job(f"{request_id}-{i}", ids, params, req.priority, text,
                    fairness_key=request_id, lora_request=lora)
                for i, (ids, text) in enumerate(prompts)]

    def _prompts(self, texts: Texts, param: str) -> list[tuple[list[int], str | None]]:
        """Texts (or token-id lists) -> (ids, text) pairs; each must fit the context whole (a
        pooling request generates nothing, so it may fill it). Runs on a preprocessing
        thread."""
        if not texts:
            raise bad_request(f"'{param}' must not be empty", param=param)
        limit = self.state.engine.max_model_len
        capacity = self.kv_capacity()
        out = []
        for t in texts:
            ids = self.prompt_token_ids(t, param)
            if len(ids) > limit or (capacity and len(ids) > capacity):
                raise bad_request(f"This model's maximum context length is "
                                  f"{min(limit, capacity or limit)} tokens, and an input of "
                                  f"'{param}' has {len(ids)}. Please shorten it.", param=param,
                                  code="context_length_exceeded")
            out.append((ids, t if isinstance(t, str) else None))
        return out

    async def _vectors(self, run: Run, render: Render) -> Response:
        vectors: dict[int, list[float]] = {}
        async with aclosing(self.outputs(run)) as outputs:
            async for i, d in outputs:
                if d.embedding is not None:
                    vectors[i] = d.embedding
        if len(vectors) != len(run.jobs):
            raise APIError(500, "a pooling request finished without its vector")
        return await self.state.off_loop(render, [vectors[i] for i in range(len(run.jobs))],
                                         run.prompt_tokens)
