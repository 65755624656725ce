"""The lifecycle every API handler shares, in ``OpenAIServing``: parse and check the request, admit
it (queue length, sequences in flight), prepare its engine requests off the event loop while it
holds its sequences, run them merged (an ignored prompt, a shutdown cut or an engine failure ends
them as an ``APIError``), count their tokens for usage and the access log, and answer whole or as
a stream; a client that leaves aborts what is unfinished, and the sequences are released however
the answer ends. Each API subclasses it with only what is its own: the request's fields, how its
prompts become engine requests, and the shape of its answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from conveyor.core.config import QueueOrder
from conveyor.core.json_depth import json_depth_exceeds
from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.entrypoints.openai.access_log import AccessRecord, access_record
from conveyor.entrypoints.openai.disconnect import cancel_on_disconnect
from conveyor.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from conveyor.entrypoints.openai.limits import (
    ListLimits,
    ServerLimits,
    check_list_sizes,
)
from conveyor.entrypoints.openai.sse import sse, sse_response
from conveyor.entrypoints.openai.structured import constraint_param
from conveyor.entrypoints.openai.unicode_text import check_text

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from conveyor.entrypoints.openai.admission import Reservation
    from conveyor.entrypoints.openai.state import ServerState
    from conveyor.lora.request import LoRARequest

R = TypeVar("R", bound=BaseModel)


@dataclass
class Job:
    """One engine request made for an HTTP request (one per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    priority: int
    prompt_text: str | None = None
    fairness_key: str | None = None  # the HTTP request's id: its prompts share one turn
    lora_request: LoRARequest | None = None  # the adapter its ``model`` names

    def prompt(self) -> dict[str, Any]:
        """The prompt as LLMEngine.add_request takes it (token ids, with the text if known)."""
        return {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt_text}


@dataclass
class Run:
    """An admitted HTTP request: its engine requests, the sequences it holds until its answer
    ends, its access-log record, and its tokens as ``OpenAIServing.outputs`` counts them."""

    request_id: str
    engine: AsyncEngine
    jobs: list[Job]
    reservation: Reservation
    record: AccessRecord
    output_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)  # job -> prompt tokens cache-served

    @property
    def prompt_tokens(self) -> int:
        return sum(len(job.prompt_token_ids) for job in self.jobs)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; ``cached_tokens``: the prompt tokens the prefix cache served."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.output_tokens,
                "total_tokens": self.prompt_tokens + self.output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Choice:
    """The output of one choice (prompt i, sample j) accumulated over its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.stop_reason is not None:
            self.stop_reason = delta.stop_reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes, model_cls: type[R], limits: ServerLimits,
               lists: ListLimits | None = None) -> R:
    """Bytes -> validated request model, each failure a 400 that says what is wrong. The JSON
    is parsed once (strictly: ``NaN`` and ``Infinity`` are not JSON); list lengths are checked
    before anything walks the lists, and every string is checked to be Unicode that encodes
    (``unicode_text``) before anything reads it."""
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    too_deep = bad_request(f"the request body nests JSON arrays/objects deeper than "
                           f"{limits.max_json_depth} levels")
    try:
        obj = json.loads(text, parse_constant=_no_constant)
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
    obj = check_text(text, obj, limits.invalid_unicode)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from e


def _shutdown_cut() -> APIError:
    """The answer to a request the shutdown timeout aborted: an error, never partial text (only
    shutdown aborts a request whose client is still waiting)."""
    return APIError(503, "The server shut down (--shutdown-timeout) before this request "
                    "finished; retry it elsewhere.", code="shutting_down")


def _engine_error(delta: RequestOutput) -> APIError | None:
    """A request the engine ignored (it can never fit) becomes a 400."""
    for c in delta.outputs:
        if c.finish_reason == "ignored":
            why = delta.finish_message or "the prompt does not fit in the context length or KV cache"
            return bad_request(f"The request cannot be served: {why}", param="prompt",
                               code="context_length_exceeded")
    return None


async def _merged_deltas(engine: AsyncEngine,
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


_max_token_chars: dict[int, int] = {}  # id(tokenizer) -> bound, computed once per tokenizer


class OpenAIServing:
    """One API's handler over the server's state; see the module docstring for the lifecycle."""

    def __init__(self, state: ServerState, limits: ServerLimits) -> None:
        self.state = state
        self.limits = limits

    # ------------------------------------------------------------ the request
    async def parse(self, request: Request, model_cls: type[R]) -> R:
        """The body as ``model_cls``, parsed on a preprocessing thread (``parse_body``)."""
        return await self.state.off_loop(parse_body, await request.body(), model_cls,
                                         self.limits, self.state.list_limits())

    def check_request(self, model: str | None, priority: int = 0) -> None:
        """The engine is ready (else a 503), ``model`` is the served model or one of its LoRA
        adapters, or unset (else a 404), and ``priority`` is honoured (else a 400)."""
        state = self.state
        state.ready_engine()
        if model is not None and model not in state.model_names and model not in state.loras:
            served = [*state.model_names, *state.loras]
            raise APIError(404, f"The model `{model}` does not exist. Served: "
                           f"{', '.join(served)}", param="model", code="model_not_found")
        if priority != 0 and state.engine_args.queue is not QueueOrder.PRIORITY:
            raise bad_request("'priority' is only honoured when the server runs with --queue "
                              f"priority (this one runs --queue {state.engine_args.queue})",
                              param="priority")

    def model_name(self, model: str | None) -> str:
        """The ``model`` an answer names: the request's, or the served model's."""
        return model or self.state.model_names[0]

    # ------------------------------------------------------------ prompts and parameters
    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Reject, before tokenizing it, a text that cannot fit the context whatever its tokens:
        tokenizing megabytes of text takes seconds of a preprocessing thread. No token decodes to
        more characters than its vocabulary entry has (a normalizer may first merge characters,
        hence the margin when there is one)."""
        tok = self.state.tokenizer
        per_token = _max_token_chars.get(id(tok))
        if per_token is None:
            per_token = max((len(t) for t in tok.get_vocab()), default=1)
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is None or backend.normalizer is not None:
                per_token *= 4
            _max_token_chars[id(tok)] = per_token
        limit = self.state.engine.max_model_len
        if chars > limit * per_token:
            raise bad_request(f"This model's maximum context length is {limit} tokens, and the "
                              f"prompt's {chars} characters are more than that many tokens can "
                              "hold. Please reduce the length of the prompt.", param=param,
                              code="context_length_exceeded")

    def prompt_token_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """One prompt (text, or token ids) as token ids: a 400 naming ``param`` for a text too
        long to tokenize, an empty prompt, or ids outside the vocabulary. Runs on a
        preprocessing thread."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), param)
        ids = self.state.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request(f"'{param}' must not be empty", param=param)
        vocab = self.state.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"'{param}' has token ids outside the vocabulary [0, {vocab}): "
                              f"{bad[:5]}", param=param)
        return ids

    def max_tokens(self, prompt_len: int, max_tokens: int | None, param: str,
                   prompt_param: str = "prompt") -> int | None:
        """Reject prompts that cannot fit, and completions the engine would have to cut short;
        return the max_tokens to ask the engine for."""
        limit = self.state.engine.max_model_len
        args = self.state.engine_args
        if limit == args.policy.seq_len_cap(args.max_num_batched_tokens):
            limit_text = (f"{limit} tokens (--max-num-batched-tokens under --policy "
                          f"{args.policy})")
        else:
            limit_text = f"{limit} tokens"
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit_text}. However, "
                              f"your prompt has {prompt_len} tokens, leaving no room for a "
                              "completion. Please reduce the length of the prompt.",
                              param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit_text}. However, "
                              f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
                              f"the prompt, {max_tokens} for the completion). Please reduce the "
                              f"length of the prompt or {param}.", param=param,
                              code="context_length_exceeded")
        capacity = self.kv_capacity()
        if capacity and prompt_len + 1 > capacity:
            raise bad_request(f"The prompt has {prompt_len} tokens but the whole KV cache holds "
                              f"{capacity} tokens; it can never be scheduled.",
                              param=prompt_param, code="context_length_exceeded")
        if capacity and max_tokens is not None and prompt_len + max_tokens > capacity:
            raise bad_request(f"The whole KV cache holds {capacity} tokens, and this request "
                              f"needs {prompt_len + max_tokens} ({prompt_len} in the prompt, "
                              f"{max_tokens} for the completion): it would be cut short. Please "
                              f"reduce {param}.", param=param, code="context_length_exceeded")
        return max_tokens

    def kv_capacity(self) -> int:
        """Tokens the whole KV cache holds (0 where the engine does not say)."""
        return self.state.engine.stats.scheduler.num_total_blocks * self.state.engine_args.block_size

    def sampling_params(self, req: Any, max_tokens: int | None) -> SamplingParams:
        """``req.sampling_params(max_tokens)``, each ValueError a 400 naming its field."""
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
        vocab = self.state.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                         ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab][:5]  # SamplingParams refused negative ones
            if bad:
                raise bad_request(f"'{name}' names token ids outside the vocabulary [0, "
                                  f"{vocab}): {bad}", param=name)
        return params

    # ------------------------------------------------------------ admission
    async def admit(self, request: Request, request_id: str, num_prompts: int, num_seqs: int,
                    prepare: Callable[[AsyncEngine], Awaitable[list[Job]]]) -> Run:
        """Admit a request of ``num_prompts`` engine requests and ``num_seqs`` sequences, then
        ``prepare`` its engine requests (tokenizing, limits, compiling a constraint) while it
        holds the sequences: admission first, so that a request the server cannot run now costs
        no tokenizing or compiling. A 503 when the queue is full, a 429 when the sequences in
        flight are; a failure of ``prepare`` releases the sequences."""
        engine = self.state.ready_engine()
        limit = self.state.max_queued_requests
        if limit is not None and engine.num_queued_requests() + num_prompts > limit:
            raise APIError(503, f"The server is overloaded: {engine.num_queued_requests()} "
                           f"requests are queued (--max-queued-requests {limit}). Retry later.",
                           code="overloaded")
        reservation = self.state.admission.reserve(num_seqs)
        try:
            jobs = await prepare(engine)
        except BaseException:
            reservation.release()
            raise
        record = access_record(request)
        record.request_id = request_id
        record.prompt_tokens = sum(len(job.prompt_token_ids) for job in jobs)
        record.output_tokens = 0
        record.prompt = "\n".join(job.prompt_text if job.prompt_text is not None
                                  else str(job.prompt_token_ids) for job in jobs)
        return Run(request_id, engine, jobs, reservation, record)

    # ------------------------------------------------------------ running
    async def outputs(self, run: Run) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(job index, delta) of the run's engine requests as they come, their tokens counted
        in ``run``; an ignored prompt (400), a shutdown cut (503) or an engine failure ends them
        with an APIError. Closing it aborts what is unfinished."""
        try:
            async with aclosing(_merged_deltas(run.engine, run.jobs)) as deltas:
                async for i, delta in deltas:
                    if (err := _engine_error(delta)) is not None:
                        raise err
                    run.cached[i] = delta.num_cached_tokens
                    run.output_tokens += sum(len(c.token_ids) for c in delta.outputs)
                    run.record.output_tokens = run.output_tokens
                    if any(c.finish_reason == "abort" for c in delta.outputs):
                        raise _shutdown_cut()
                    yield i, delta
        except APIError:
            raise
        except Exception as e:
            raise self.state.api_error(e) from e

    async def full_response(self, request: Request, run: Run,
                            response: Awaitable[Response]) -> Response:
        """``response`` once it is ready; a client that leaves first cancels it, which aborts
        the run's engine requests (499). The run's sequences are released either way."""
        try:
            return await cancel_on_disconnect(request, response)
        finally:
            run.reservation.release()

    def stream_response(self, run: Run, events: AsyncIterator[str]) -> StreamingResponse:
        """``events`` as server-sent events; the run's sequences are released once the stream
        has ended, however it ended (a client that leaves closes it, aborting the run)."""
        return sse_response(events, on_close=run.reservation.release)

    async def chunk_events(self, run: Run, head: dict[str, Any], include_usage: bool,
                           choices: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """OpenAI's stream of chunks: one per choice delta of ``choices``, an error chunk where
        they fail, the usage chunk when asked for, then ``[DONE]``."""
        extra = {"usage": None} if include_usage else {}
        try:
            async with aclosing(choices):
                async for choice in choices:
                    yield sse({**head, "choices": [choice], **extra})
        except Exception as e:
            yield sse(self.state.api_error(e).body())
        if include_usage:
            yield sse({**head, "choices": [], "usage": run.usage()})
        yield sse("[DONE]")
