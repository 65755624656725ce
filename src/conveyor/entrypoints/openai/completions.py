"""POST /v1/completions: one engine request per prompt, streamed (SSE) or returned whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.entrypoints.openai.access_log import AccessRecord, access_record
from conveyor.entrypoints.openai.disconnect import cancel_on_disconnect
from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.prompt_logprobs import (
    check_prompt_logprobs,
    echo_logprobs,
    prepend,
    vllm_prompt_logprobs,
)
from conveyor.entrypoints.openai.protocol import CompletionRequest
from conveyor.entrypoints.openai.serving import (
    Choice,
    Job,
    TokenText,
    check_admission,
    check_model,
    check_not_cut,
    check_priority,
    engine_error,
    make_params,
    merged_deltas,
    new_id,
    now_s,
    parse_body,
    prompt_token_ids,
    resolve_max_tokens,
    sampled_logprob,
    shutdown_cut,
    sse,
    sse_response,
    top_entries,
    usage,
)
from conveyor.entrypoints.openai.structured import compile_constraint, constraint_param

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import Logprob
    from conveyor.entrypoints.openai.state import ServerState


def _num_prompts(prompt: Any) -> int:
    """How many prompts the prompt field holds (a string or token ids are one)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _prompts(state: ServerState, prompt: Any, echo: bool) -> list[tuple[list[int], str | None]]:
    """The prompt field (str, list of str, token ids, list of token ids) -> (ids, text) pairs;
    with ``echo``, token-id prompts get their decoded text. Runs on a preprocessing thread."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    out = []
    for p in prompt:
        ids = prompt_token_ids(state, p, "prompt")
        text = p if isinstance(p, str) else (state.tokenizer.decode(ids) if echo else None)
        out.append((ids, text))
    return out


def _logprobs(tok: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]], n: int,
              offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = tok(token_id, entry.get(token_id))
        tokens.append(text)
        token_logprobs.append(sampled_logprob(entry, token_id))
        tops.append({tok(t, lp): lp.logprob for t, lp in top_entries(entry, n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


async def create_completion(state: ServerState, request: Request,
                            limits: ServerLimits | None = None) -> Response:
    req: CompletionRequest = await state.off_loop(parse_body, await request.body(),
                                                  CompletionRequest, limits,
                                                  state.list_limits())
    state.ready_engine()
    check_model(state, req.model)
    check_priority(state, req.priority)
    if req.suffix:
        raise bad_request("'suffix' is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("'best_of' must equal 'n' (or be omitted)", param="best_of")
    check_prompt_logprobs(req)
    # admission first: a request the server cannot run now costs no tokenizing or compiling
    num_prompts = _num_prompts(req.prompt)
    engine = check_admission(state, num_prompts)
    reservation = state.admission.reserve(num_prompts * req.n)
    try:
        prompts = await state.off_loop(_prompts, state, req.prompt, req.echo)
        base_id = new_id("cmpl")
        jobs = []
        for i, (ids, text) in enumerate(prompts):
            max_tokens = resolve_max_tokens(state, len(ids), req.max_tokens, "max_tokens")
            jobs.append(Job(f"{base_id}-{i}", ids, make_params(state, req, max_tokens),
                            req.priority, text, fairness_key=base_id,
                            lora_request=state.lora_request(req.model)))
        await compile_constraint(engine, jobs[0].params, constraint_param(req), request)
    except BaseException:
        reservation.release()
        raise
    record = access_record(request)
    record.request_id = base_id
    record.prompt_tokens = sum(len(job.prompt_token_ids) for job in jobs)
    record.output_tokens = 0
    record.prompt = "\n".join(text if text is not None else str(ids) for ids, text in prompts)
    echo_text = [(text or "") if req.echo else "" for _, text in prompts]
    head = {"id": base_id, "object": "text_completion", "created": now_s(),
            "model": req.model or state.model_names[0]}
    tok = TokenText(state.tokenizer)
    if req.stream:
        return sse_response(_stream(state, engine, req, jobs, head, echo_text, tok, record),
                            on_close=reservation.release)
    try:
        return await cancel_on_disconnect(request, _whole(state, engine, req, jobs, head,
                                                          echo_text, tok, record))
    finally:
        reservation.release()


async def _whole(state: ServerState, engine: AsyncEngine, req: CompletionRequest, jobs: list[Job],
                 head: dict[str, Any], echo_text: list[str], tok: TokenText,
                 record: AccessRecord) -> Response:
    choices = {(i, j): Choice() for i in range(len(jobs)) for j in range(req.n)}
    scored: dict[int, Any] = {}  # job -> its prompt logprobs
    cached: dict[int, int] = {}  # job -> its prompt tokens served by the prefix cache
    try:
        async with aclosing(merged_deltas(engine, jobs)) as deltas:
            async for i, d in deltas:
                if (err := engine_error(d)) is not None:
                    raise err
                cached[i] = d.num_cached_tokens
                if d.prompt_logprobs is not None:
                    scored[i] = d.prompt_logprobs
                for c in d.outputs:
                    ch = choices[(i, c.index)]
                    ch.text += c.text
                    ch.token_ids += c.token_ids
                    ch.logprobs += c.logprobs or []
                    ch.finish_reason = c.finish_reason or ch.finish_reason
    except APIError:
        raise
    except Exception as e:
        raise state.api_error(e) from e
    check_not_cut([ch.finish_reason for ch in choices.values()])
    out = []
    for (i, j), ch in sorted(choices.items()):
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(tok, ch.token_ids, ch.logprobs, req.logprobs, len(echo_text[i]))
            if req.echo:
                lp = prepend(echo_logprobs(tok, jobs[i].prompt_token_ids, scored.get(i),
                                           req.logprobs), lp)
        choice = {"index": i * req.n + j, "text": echo_text[i] + ch.text, "logprobs": lp,
                  "finish_reason": ch.finish_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(scored.get(i))
        out.append(choice)
    prompt_tokens = sum(len(job.prompt_token_ids) for job in jobs)
    completion_tokens = sum(len(ch.token_ids) for ch in choices.values())
    record.output_tokens = completion_tokens
    return JSONResponse({**head, "choices": out,
                         "usage": usage(prompt_tokens, completion_tokens, sum(cached.values())),
                         "system_fingerprint": None})


async def _stream(state: ServerState, engine: AsyncEngine, req: CompletionRequest, jobs: list[Job],
                  head: dict[str, Any], echo_text: list[str], tok: TokenText,
                  record: AccessRecord) -> AsyncIterator[str]:
    extra = {"usage": None} if req.include_usage else {}
    started: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}  # job -> its prompt tokens served by the prefix cache
    try:
        async with aclosing(merged_deltas(engine, jobs)) as deltas:
            async for i, d in deltas:
                if (err := engine_error(d)) is not None:
                    yield sse(err.body())
                    break
                cached[i] = d.num_cached_tokens
                if any(c.finish_reason == "abort" for c in d.outputs):
                    yield sse(shutdown_cut().body())
                for c in d.outputs:
                    key = (i, c.index)
                    completion_tokens += len(c.token_ids)
                    record.output_tokens = completion_tokens
                    text = c.text
                    first = key not in started
                    if first:
                        started.add(key)
                        text = echo_text[i] + text
                        offsets[key] = len(echo_text[i])
                    lp = None
                    if req.logprobs is not None:
                        lp = _logprobs(tok, c.token_ids, c.logprobs or [], req.logprobs,
                                       offsets[key])
                        offsets[key] += sum(len(t) for t in lp["tokens"])
                        if req.echo and first:
                            lp = prepend(echo_logprobs(tok, jobs[i].prompt_token_ids,
                                                       d.prompt_logprobs, req.logprobs), lp)
                    if not text and c.finish_reason is None and not c.token_ids:
                        continue
                    choice = {"index": i * req.n + c.index, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason}
                    yield sse({**head, "choices": [choice], **extra})
    except Exception as e:
        yield sse(state.api_error(e).body())
    if req.include_usage:
        prompt_tokens = sum(len(job.prompt_token_ids) for job in jobs)
        yield sse({**head, "choices": [],
                   "usage": usage(prompt_tokens, completion_tokens, sum(cached.values()))})
    yield sse("[DONE]")
