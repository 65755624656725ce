"""The pooling endpoints: ``POST /v1/embeddings`` (OpenAI's shape), ``POST /v1/score`` (vLLM's)
and ``POST /v1/rerank`` (Jina's / Cohere's, also at ``/rerank`` and ``/v2/rerank``).

Each text becomes one pooling request of the engine (``PoolingParams``), admitted, limited and
aborted like a completion's prompt; score and rerank compare the vectors by cosine similarity
(``engine/scoring.py``).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.core.pooling_params import PoolingParams
from conveyor.engine.scoring import pair_scores, score_inputs
from conveyor.entrypoints.openai.access_log import access_record
from conveyor.entrypoints.openai.disconnect import cancel_on_disconnect
from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.serving import (
    Job,
    check_admission,
    check_model,
    check_not_cut,
    check_priority,
    engine_error,
    merged_deltas,
    new_id,
    now_s,
    parse_body,
    prompt_token_ids,
)

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.state import ServerState


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

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


def _prompts(state: ServerState, texts: Texts, param: str) -> list[tuple[list[int], str | None]]:
    """Texts (or token-id lists) -> (ids, text) pairs; each must fit the context whole (a
    pooling request generates nothing, so it may fill it). Runs on a preprocessing thread."""
    if not texts:
        raise bad_request(f"'{param}' must not be empty", param=param)
    limit = state.engine.max_model_len
    capacity = state.engine.stats.scheduler.num_total_blocks * state.engine_args.block_size
    out = []
    for t in texts:
        ids = prompt_token_ids(state, t, param)
        if len(ids) > limit or (capacity and len(ids) > capacity):
            raise bad_request(f"This model's maximum context length is "
                              f"{min(limit, capacity or limit)} tokens, and an input of '{param}' "
                              f"has {len(ids)}. Please shorten it.", param=param,
                              code="context_length_exceeded")
        out.append((ids, t if isinstance(t, str) else None))
    return out


async def _embed(state: ServerState, request: Request, limits: ServerLimits | None,
                 req: _Request, texts: Texts, param: str, params: PoolingParams,
                 kind: str) -> tuple[list[list[float]], int]:
    """The vector of each text, in order, and the prompt tokens they took."""
    state.ready_engine()
    check_model(state, req.model)
    check_priority(state, req.priority)
    max_prompts = (limits or ServerLimits()).max_prompts
    if len(texts) > max_prompts:
        raise bad_request(f"'{param}' has {len(texts)} inputs; at most {max_prompts} are "
                          "allowed in one request (--max-prompts-per-request)", param=param,
                          code="too_many_prompts")
    engine = check_admission(state, len(texts))
    reservation = state.admission.reserve(len(texts))
    try:
        prompts = await state.off_loop(_prompts, state, texts, param)
        base_id = new_id(kind)
        lora = state.lora_request(req.model)
        jobs = [Job(f"{base_id}-{i}", ids, params, req.priority, text, fairness_key=base_id,
                    lora_request=lora) for i, (ids, text) in enumerate(prompts)]
        record = access_record(request)
        record.request_id = base_id
        record.prompt_tokens = sum(len(job.prompt_token_ids) for job in jobs)
        record.output_tokens = 0
        return await cancel_on_disconnect(request, _run(state, engine, jobs))
    finally:
        reservation.release()


async def _run(state: ServerState, engine: Any, jobs: list[Job]) -> tuple[list[list[float]], int]:
    vectors: dict[int, list[float]] = {}
    reasons = []
    try:
        async for i, d in merged_deltas(engine, jobs):
            if (err := engine_error(d)) is not None:
                raise err
            reasons += [c.finish_reason for c in d.outputs]
            if d.embedding is not None:
                vectors[i] = d.embedding
    except APIError:
        raise
    except Exception as e:
        raise state.api_error(e) from e
    check_not_cut(reasons)
    if len(vectors) != len(jobs):
        raise APIError(500, "a pooling request finished without its vector")
    return [vectors[i] for i in range(len(jobs))], sum(len(j.prompt_token_ids) for j in jobs)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # what OpenAI's client asks for: little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(state: ServerState, request: Request,
                           limits: ServerLimits | None = None) -> Response:
    req: EmbeddingRequest = await state.off_loop(parse_body, await request.body(),
                                                 EmbeddingRequest, limits, state.list_limits(),
                                                 False)
    texts: Texts = [req.input] if isinstance(req.input, str) else req.input
    if texts and isinstance(texts[0], int):
        texts = [texts]  # one prompt as token ids
    # the engine resolves these against the model's pooling (a 400 for dimensions it lacks)
    params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    vectors, prompt_tokens = await _embed(state, request, limits, req, texts, "input", params,
                                          "embd")
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data,
                         "model": req.model or state.model_names[0],
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


async def create_score(state: ServerState, request: Request,
                       limits: ServerLimits | None = None) -> Response:
    req: ScoreRequest = await state.off_loop(parse_body, await request.body(), ScoreRequest,
                                             limits, state.list_limits(), False)
    try:
        texts, pairs = score_inputs(req.text_1, req.text_2)
    except ValueError as e:
        raise bad_request(str(e), param="text_2") from e
    vectors, prompt_tokens = await _embed(state, request, limits, req, texts, "text_1",
                                          PoolingParams(), "score")
    scores = pair_scores(vectors, pairs)
    return JSONResponse({"id": new_id("score"), "object": "list", "created": now_s(),
                         "model": req.model or state.model_names[0],
                         "data": [{"index": k, "object": "score", "score": s}
                                  for k, s in enumerate(scores)],
                         "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


async def create_rerank(state: ServerState, request: Request,
                        limits: ServerLimits | None = None) -> Response:
    req: RerankRequest = await state.off_loop(parse_body, await request.body(), RerankRequest,
                                              limits, state.list_limits(), False)
    if not req.documents:
        raise bad_request("'documents' must hold at least one document", param="documents")
    texts, pairs = score_inputs(req.query, req.documents)
    vectors, prompt_tokens = await _embed(state, request, limits, req, texts, "documents",
                                          PoolingParams(), "rerank")
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
    return JSONResponse({"id": new_id("rerank"), "model": req.model or state.model_names[0],
                         "usage": {"total_tokens": prompt_tokens}, "results": results})
