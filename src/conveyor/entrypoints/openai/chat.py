"""POST /v1/chat/completions: messages through the model's chat template, then one engine request.
With ``--reasoning-parser`` the reply's reasoning is ``reasoning_content`` (whole, and streamed as
deltas), apart from the ``content`` that tool calls are parsed from and a constraint applies to."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from conveyor.entrypoints.openai.access_log import AccessRecord, access_record
from conveyor.entrypoints.openai.disconnect import cancel_on_disconnect
from conveyor.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.prompt_logprobs import (
    check_prompt_logprobs,
    vllm_prompt_logprobs,
)
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from conveyor.entrypoints.openai.serving import (
    Choice,
    Job,
    TokenText,
    check_admission,
    check_model,
    check_not_cut,
    check_priority,
    check_prompt_chars,
    engine_error,
    make_params,
    merged_deltas,
    new_id,
    now_s,
    parse_body,
    resolve_max_tokens,
    shutdown_cut,
    sse,
    sse_response,
    top_entries,
    usage,
)
from conveyor.entrypoints.openai.structured import compile_constraint, constraint_param
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream, tool_calls_json

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import Logprob
    from conveyor.entrypoints.openai.admission import Reservation
    from conveyor.entrypoints.openai.state import ServerState


def _logprobs(tok: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]],
              n: int) -> dict[str, Any]:
    def item(token_id: int, logprob: Logprob | None) -> dict[str, Any]:
        text = tok(token_id, logprob)
        return {"token": text, "logprob": None if logprob is None else logprob.logprob,
                "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        content.append({**item(token_id, entry.get(token_id)),
                        "top_logprobs": [item(t, lp) for t, lp in top_entries(entry, n)]})
    return {"content": content}


async def create_chat_completion(state: ServerState, request: Request,
                                 limits: ServerLimits | None = None) -> Response:
    req: ChatCompletionRequest = await state.off_loop(parse_body, await request.body(),
                                                      ChatCompletionRequest, limits,
                                                      state.list_limits())
    run = await start_chat(state, request, req, "chatcmpl")
    head = {"id": run.job.request_id, "object": "chat.completion", "created": now_s(),
            "model": req.model or state.model_names[0]}
    tok = TokenText(state.tokenizer)
    if req.stream:
        return sse_response(_stream(state, run.engine, req, run.job, head, tok, run.record,
                                    run.tools), on_close=run.reservation.release)
    try:
        return await cancel_on_disconnect(request, _whole(state, run.engine, req, run.job, head,
                                                          tok, run.record, run.tools))
    finally:
        run.reservation.release()


def chat_request_from(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request translates to (fields set to None left out);
    a 400 naming the field where it does not validate."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})
    except ValidationError as e:
        raise from_validation_error(e) from e


@dataclass
class ChatRun:
    """A chat request admitted and ready to run; whoever runs it releases ``reservation``."""

    engine: AsyncEngine
    job: Job
    tools: ToolMode
    reservation: Reservation
    record: AccessRecord


async def start_chat(state: ServerState, request: Request, req: ChatCompletionRequest,
                     id_prefix: str) -> ChatRun:
    """Check a parsed chat request, admit it, render its prompt and compile its constraint;
    each failure an APIError (the reservation released)."""
    state.ready_engine()
    check_model(state, req.model)
    check_priority(state, req.priority)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    check_prompt_logprobs(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    messages = [_message(m) for m in req.messages]
    check_prompt_chars(state, sum(len(m["content"]) for m in messages), "messages")
    template = getattr(state.tokenizer, "chat_template", None)
    try:
        tools = ToolMode.of(req, template)
        req._tool_constraint = tools.constraint()
    except ValueError as e:
        raise bad_request(str(e), param="tool_choice" if req.tools else "tools") from e
    messages, template_tools = tools.prompt_messages(messages, template)
    # admission first: a request the server cannot run now costs no templating or compiling
    engine = check_admission(state, 1)
    reservation = state.admission.reserve(req.n)
    try:
        try:
            prompt = await state.off_loop(state.encode_chat, messages, req.add_generation_prompt,
                                          template_tools)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise bad_request(f"the chat template rejected the messages: {e}",
                              param="messages") from e
        prompt_ids = prompt["prompt_token_ids"]
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(state, len(prompt_ids), req.requested_max_tokens, param,
                                        prompt_param="messages")
        job = Job(new_id(id_prefix), prompt_ids, make_params(state, req, max_tokens),
                  req.priority, prompt["prompt"], lora_request=state.lora_request(req.model))
        constraint = job.params.structured_outputs
        if constraint is not None and state.reasoning_parser is not None:  # the answer only
            job.params.structured_outputs = replace(
                constraint, **state.reasoning_parser.constraint_markers(state.tokenizer))
        await compile_constraint(engine, job.params, constraint_param(req), request)
    except BaseException:
        reservation.release()
        raise
    record = access_record(request)
    record.request_id = job.request_id
    record.prompt_tokens = len(prompt_ids)
    record.output_tokens = 0
    record.prompt = prompt["prompt"]
    return ChatRun(engine, job, tools, reservation, record)


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


async def _whole(state: ServerState, engine: AsyncEngine, req: ChatCompletionRequest, job: Job,
                 head: dict[str, Any], tok: TokenText, record: AccessRecord,
                 tools: ToolMode) -> Response:
    choices = [Choice() for _ in range(req.n)]
    scored = None
    cached = 0  # prompt tokens served by the prefix cache
    try:
        async with aclosing(merged_deltas(engine, [job])) as deltas:
            async for _, d in deltas:
                if (err := engine_error(d)) is not None:
                    raise err
                cached = d.num_cached_tokens
                scored = d.prompt_logprobs or scored
                for c in d.outputs:
                    ch = choices[c.index]
                    ch.text += c.text
                    ch.token_ids += c.token_ids
                    ch.logprobs += c.logprobs or []
                    ch.finish_reason = c.finish_reason or ch.finish_reason
    except APIError:
        raise
    except Exception as e:
        raise state.api_error(e) from e
    check_not_cut([ch.finish_reason for ch in choices])
    top_n = req.top_logprobs or 0
    out = []
    for j, ch in enumerate(choices):
        reasoning, answer = split_reasoning(state.reasoning_parser, ch.text)
        content, calls = tools.parse(answer)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if state.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = tool_calls_json(calls)
        out.append({"index": j, "message": message,
                    "logprobs": (_logprobs(tok, ch.token_ids, ch.logprobs, top_n)
                                 if req.logprobs else None),
                    "finish_reason": _finish_reason(ch.finish_reason, bool(calls))})
    completion_tokens = sum(len(ch.token_ids) for ch in choices)
    record.output_tokens = completion_tokens
    return JSONResponse({**head, "choices": out,
                         "usage": usage(len(job.prompt_token_ids), completion_tokens, cached),
                         "system_fingerprint": None,
                         **({"prompt_logprobs": vllm_prompt_logprobs(scored)}
                            if req.prompt_logprobs is not None else {})})


async def _stream(state: ServerState, engine: AsyncEngine, req: ChatCompletionRequest, job: Job,
                  head: dict[str, Any], tok: TokenText, record: AccessRecord,
                  tools: ToolMode) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if req.include_usage else {}
    top_n = req.top_logprobs or 0

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return sse({**head, "choices": [choice], **extra})

    for j in range(req.n):
        yield chunk(j, {"role": "assistant", "content": "" if tools.kind != "named" else None})
    completion_tokens = 0
    cached = 0  # prompt tokens served by the prefix cache
    streams = [ToolStream(tools) for _ in range(req.n)] if tools.kind is not None else None
    thoughts = [ReasoningStream(state.reasoning_parser) for _ in range(req.n)]
    try:
        async with aclosing(merged_deltas(engine, [job])) as deltas:
            async for _, d in deltas:
                if (err := engine_error(d)) is not None:
                    yield sse(err.body())
                    break
                cached = d.num_cached_tokens
                if any(c.finish_reason == "abort" for c in d.outputs):
                    yield sse(shutdown_cut().body())
                for c in d.outputs:
                    completion_tokens += len(c.token_ids)
                    record.output_tokens = completion_tokens
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    lp = _logprobs(tok, c.token_ids, c.logprobs or [], top_n) if req.logprobs \
                        else None
                    reasoning, text = thoughts[c.index].feed(c.text, c.finish_reason is not None)
                    if reasoning:
                        yield chunk(c.index, {"reasoning_content": reasoning}, None, lp)
                        lp = None
                        if not text and c.finish_reason is None:
                            continue
                    if streams is None:
                        yield chunk(c.index, {"content": text} if text else {},
                                    c.finish_reason, lp)
                        continue
                    for event in _tool_stream_chunks(streams[c.index], text, c.finish_reason):
                        yield chunk(c.index, *event, lp)
                        lp = None
    except Exception as e:
        yield sse(state.api_error(e).body())
    if req.include_usage:
        yield sse({**head, "choices": [],
                   "usage": usage(len(job.prompt_token_ids), completion_tokens, cached)})
    yield sse("[DONE]")


def _tool_stream_chunks(stream: ToolStream, text: str,
                        finish_reason: str | None) -> list[tuple[dict[str, Any], str | None]]:
    """(delta, finish_reason) of one engine delta of a choice that may call tools."""
    fed = stream.feed(text) if text or finish_reason is not None else []  # not mid-reasoning
    events: list[tuple[dict[str, Any], str | None]] = [(d, None) for d in fed]
    if finish_reason is not None:
        tail, called = stream.finish()
        events += [(d, None) for d in tail]
        events.append(({}, _finish_reason(finish_reason, called)))
    return events
