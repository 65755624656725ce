"""What /v1/completions and /v1/chat/completions share: admission checks, the engine requests of
one HTTP request, merged streaming of their deltas, usage and logprobs formatting, and
cancellation when the client goes away.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from conveyor.core.config import QueueOrder
from conveyor.core.json_depth import json_depth_exceeds
from conveyor.core.sampling_params import SamplingParams
from conveyor.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from conveyor.entrypoints.openai.limits import (
    ListLimits,
    ServerLimits,
    check_list_sizes,
    check_sizes,
)
from conveyor.entrypoints.openai.structured import constraint_param

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import Logprob, RequestOutput
    from conveyor.entrypoints.openai.state import ServerState
    from conveyor.lora.request import LoRARequest


@dataclass
class Job:
    """One engine request made for an HTTP request (one per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    prompt_text: str | None = None
    fairness_key: str | None = None  # the HTTP request's id: its prompts share one turn
    lora_request: LoRARequest | None = None  # the adapter its ``model`` names

    def prompt(self) -> dict[str, Any]:
        """The prompt as LLMEngine.add_request takes it (token ids, with the text if known)."""
        return {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt_text}


@dataclass
class Choice:
    """Accumulated output of one choice (prompt i, sample j) for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


def shutdown_cut() -> APIError:
    """The answer to a request the shutdown timeout aborted: an error, never partial text."""
    return APIError(503, "The server shut down (--shutdown-timeout) before this request "
                    "finished; retry it elsewhere.", code="shutting_down")


def check_not_cut(finish_reasons: list[str | None]) -> None:
    """A whole response whose choices were aborted is a 503 (only shutdown aborts a request
    whose client is still waiting)."""
    if "abort" in finish_reasons:
        raise shutdown_cut()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def parse_body(raw: bytes, model_cls: type[Any], limits: ServerLimits | None = None,
               lists: ListLimits | None = None, sizes: bool = True) -> Any:
    """Bytes -> validated request model, each failure a 400 that says what is wrong. The JSON
    is parsed once; list lengths are checked before anything walks the lists; ``sizes``: the
    OpenAI fields' sizes too (``check_sizes``)."""
    limits = limits or ServerLimits()
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    too_deep = bad_request(f"the request body nests JSON arrays/objects deeper than "
                           f"{limits.max_json_depth} levels")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, "
                          f"column {e.colno})") from e
    except RecursionError as e:
        raise too_deep from e
    except ValueError as e:  # e.g. an integer literal of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    check_list_sizes(obj, limits, lists)
    if json_depth_exceeds(obj, limits.max_json_depth):
        raise too_deep
    try:
        req = model_cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from e
    if sizes:
        check_sizes(req, limits)
    return req


_max_token_chars: dict[int, int] = {}  # id(tokenizer) -> bound, computed once per tokenizer


def check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    """Reject, before tokenizing it, a text that cannot fit the context whatever its tokens:
    tokenizing megabytes of text takes seconds of a preprocessing thread. No token decodes to more characters than its vocabulary entry has (a normalizer
    may first merge characters, hence the margin when there is one)."""
    tok = state.tokenizer
    per_token = _max_token_chars.get(id(tok))
    if per_token is None:
        per_token = max((len(t) for t in tok.get_vocab()), default=1)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            per_token *= 4
        _max_token_chars[id(tok)] = per_token
    limit = state.engine.max_model_len
    if chars > limit * per_token:
        raise bad_request(f"This model's maximum context length is {limit} tokens, and the "
                          f"prompt's {chars} characters are more than that many tokens can "
                          "hold. Please reduce the length of the prompt.", param=param,
                          code="context_length_exceeded")


def prompt_token_ids(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    """One prompt (text, or token ids) as token ids: a 400 naming ``param`` for a text too long
    to tokenize, an empty prompt, or ids outside the vocabulary. Runs on a preprocessing
    thread."""
    if isinstance(prompt, str):
        check_prompt_chars(state, len(prompt), param)
    ids = state.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request(f"'{param}' must not be empty", param=param)
    vocab = state.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'{param}' has token ids outside the vocabulary [0, {vocab}): "
                          f"{bad[:5]}", param=param)
    return ids


def check_model(state: ServerState, model: str | None) -> None:
    """``model`` is the served model or one of its LoRA adapters (or unset): else a 404."""
    if model is not None and model not in state.model_names and model not in state.loras:
        served = [*state.model_names, *state.loras]
        raise APIError(404, f"The model `{model}` does not exist. Served: "
                       f"{', '.join(served)}", param="model", code="model_not_found")


def check_priority(state: ServerState, priority: int) -> None:
    if priority != 0 and state.engine_args.queue is not QueueOrder.PRIORITY:
        raise bad_request("'priority' is only honoured when the server runs with --queue priority "
                          f"(this one runs --queue {state.engine_args.queue})", param="priority")


def resolve_max_tokens(state: ServerState, prompt_len: int, max_tokens: int | None,
                       param: str, prompt_param: str = "prompt") -> int | None:
    """Reject prompts that cannot fit, and completions the engine would have to cut short;
    return the max_tokens to ask the engine for."""
    limit = state.engine.max_model_len
    args = state.engine_args
    if limit == args.policy.seq_len_cap(args.max_num_batched_tokens):
        limit_text = f"{limit} tokens (--max-num-batched-tokens under --policy {args.policy})"
    else:
        limit_text = f"{limit} tokens"
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit_text}. However, your "
                          f"prompt has {prompt_len} tokens, leaving no room for a completion. "
                          "Please reduce the length of the prompt.", param=prompt_param,
                          code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit_text}. However, you "
                          f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                          f"{max_tokens} for the completion). Please reduce the length of the "
                          f"prompt or {param}.", param=param, code="context_length_exceeded")
    capacity = state.engine.stats.scheduler.num_total_blocks * state.engine_args.block_size
    if capacity and prompt_len + 1 > capacity:
        raise bad_request(f"The prompt has {prompt_len} tokens but the whole KV cache holds "
                          f"{capacity} tokens; it can never be scheduled.", param=prompt_param,
                          code="context_length_exceeded")
    if capacity and max_tokens is not None and prompt_len + max_tokens > capacity:
        raise bad_request(f"The whole KV cache holds {capacity} tokens, and this request needs "
                          f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} "
                          f"for the completion): it would be cut short. Please reduce {param}.",
                          param=param, code="context_length_exceeded")
    return max_tokens


def make_params(state: ServerState, req: Any, max_tokens: int | None) -> SamplingParams:
    try:
        params = req.sampling_params(max_tokens)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("SamplingParams."):
            param = msg.split(" ", 1)[0].removeprefix("SamplingParams.")
        elif msg.startswith(("structured_outputs", "response_format")):
            param = constraint_param(req)
        else:
            param = None
        raise bad_request(msg.removeprefix("SamplingParams."), param=param) from e
    vocab = state.vocab_size
    if params.logit_bias and max(params.logit_bias) >= vocab:
        bad = [t for t in params.logit_bias if t >= vocab][:5]
        raise bad_request(f"'logit_bias' names token ids outside the vocabulary [0, {vocab}): "
                          f"{bad}", param="logit_bias")
    return params


def check_admission(state: ServerState, num_jobs: int) -> AsyncEngine:
    engine = state.ready_engine()
    limit = state.max_queued_requests
    if limit is not None and engine.num_queued_requests() + num_jobs > limit:
        raise APIError(503, f"The server is overloaded: {engine.num_queued_requests()} requests "
                       f"are queued (--max-queued-requests {limit}). Retry later.",
                       code="overloaded")
    return engine


async def merged_deltas(engine: AsyncEngine,
                        jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job index, delta) from every job as they come; closing it aborts what is unfinished."""
    if len(jobs) == 1:
        job = jobs[0]
        async with aclosing(engine.generate(job.prompt(), job.params, job.request_id,
                                            job.priority, job.fairness_key,
                                            lora_request=job.lora_request)) as gen:
            async for delta in gen:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, job: Job) -> None:
        try:
            async with aclosing(engine.generate(job.prompt(), job.params, job.request_id,
                                                job.priority, job.fairness_key,
                                                lora_request=job.lora_request)) as gen:
                async for delta in gen:
                    queue.put_nowait((i, delta))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(delta: RequestOutput) -> APIError | None:
    """A request the engine ignored (it can never fit) becomes a 400."""
    for c in delta.outputs:
        if c.finish_reason == "ignored":
            why = delta.finish_message or "the prompt does not fit in the context length or KV cache"
            return bad_request(f"The request cannot be served: {why}", param="prompt",
                               code="context_length_exceeded")
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """token id -> its text as OpenAI shows it in logprobs (decoded, not the BPE symbol)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id])
            self._cache[token_id] = text
        return text


def sampled_logprob(entry: dict[int, Logprob], token_id: int) -> float | None:
    lp = entry.get(token_id)
    return None if lp is None else lp.logprob


def top_entries(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The n most likely (token, Logprob) of one position."""
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def sse(obj: dict[str, Any] | str) -> str:
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """A named server-sent event whose data carries its name as ``type`` (Anthropic's and the
    Responses API's streams)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _StreamThenRelease(StreamingResponse):
    """A stream that calls ``on_close`` once it has ended, however it ended."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(events: AsyncIterator[str],
                 on_close: Callable[[], None] = lambda: None) -> StreamingResponse:
    return _StreamThenRelease(events, on_close)
