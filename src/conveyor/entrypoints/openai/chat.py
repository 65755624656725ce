"""POST /v1/chat/completions: messages through the model's chat template, then one engine request.
With ``--reasoning-parser`` the reply's reasoning is ``reasoning_content`` (whole, and streamed as
deltas), apart from the ``content`` that tool calls are parsed from and a constraint applies to.
``OpenAIServingChat.start_chat`` is the chat path the Anthropic and Responses APIs run on too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from conveyor.entrypoints.openai.errors import bad_request, from_validation_error
from conveyor.entrypoints.openai.limits import check_sizes
from conveyor.entrypoints.openai.logprobs import (
    TokenText,
    check_prompt_logprobs,
    top_entries,
    vllm_prompt_logprobs,
)
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from conveyor.entrypoints.openai.serving import Choice, Job, OpenAIServing, Run, new_id, now_s
from conveyor.entrypoints.openai.structured import compile_constraint, constraint_param
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream, tool_calls_json

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import Logprob


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


def chat_request_from(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request translates to (fields set to None left out);
    a 400 naming the field where it does not validate."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})
    except ValidationError as e:
        raise from_validation_error(e) from e


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        run, tools = await self.start_chat(request, req, "chatcmpl")
        head = {"id": run.request_id, "object": "chat.completion", "created": now_s(),
                "model": self.model_name(req.model)}
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return self.stream_response(run, self.chunk_events(
                run, head, req.include_usage, self._choice_deltas(run, req, tools)))
        return await self.full_response(request, run, self._whole(run, req, head, tools))

    async def start_chat(self, request: Request, req: ChatCompletionRequest,
                         id_prefix: str) -> tuple[Run, ToolMode]:
        """Check a parsed chat request, admit it, render its prompt and compile its constraint;
        each failure an APIError (the sequences released)."""
        check_sizes(req, self.limits)
        self.check_request(req.model, req.priority)
        if not req.messages:
            raise bad_request("'messages' must contain at least one message", param="messages")
        check_prompt_logprobs(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        messages = [_message(m) for m in req.messages]
        self.check_prompt_chars(sum(_chars(m) for m in messages), "messages")
        template = getattr(self.state.tokenizer, "chat_template", None)
        try:
            tools = ToolMode.of(req, template, self.state.tool_call_parser)
            req._tool_constraint = tools.constraint()
        except ValueError as e:
            raise bad_request(str(e), param="tool_choice" if req.tools else "tools") from e
        request_id = new_id(id_prefix)
        run = await self.admit(request, request_id, 1, req.n,
                               partial(self._job, request, req, messages, tools, request_id))
        return run, tools

    def _prompt(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                tools: ToolMode) -> dict[str, Any]:
        """The conversation and its tools through the chat template, on a preprocessing
        thread: everything the template renders (the tools' JSON included) is held to the
        context's character bound before rendering begins."""
        template = getattr(self.state.tokenizer, "chat_template", None)
        messages, template_tools = tools.prompt_messages(messages, template)
        chars = sum(_chars(m) for m in messages)
        if template_tools:
            chars += len(json.dumps(template_tools, ensure_ascii=False))
        self.check_prompt_chars(chars, "tools")  # the messages alone were checked before
        try:
            return self.state.encode_chat(messages, req.add_generation_prompt, template_tools)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise bad_request(f"the chat template rejected the messages: {e}",
                              param="messages") from e

    async def _job(self, request: Request, req: ChatCompletionRequest,
                   messages: list[dict[str, Any]], tools: ToolMode, request_id: str,
                   engine: AsyncEngine) -> list[Job]:
        state = self.state
        prompt = await state.off_loop(self._prompt, req, messages, tools)
        prompt_ids = prompt["prompt_token_ids"]
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(len(prompt_ids), req.requested_max_tokens, param,
                                     prompt_param="messages")
        params = self.sampling_params(req, max_tokens)
        constraint = params.structured_outputs
        if constraint is not None and state.reasoning_parser is not None:  # the answer only
            params.structured_outputs = replace(
                constraint, **state.reasoning_parser.constraint_markers(state.tokenizer))
        await compile_constraint(engine, params, constraint_param(req), request)
        return [Job(request_id, prompt_ids, params, req.priority, prompt["prompt"],
                    lora_request=state.lora_request(req.model))]

    async def _whole(self, run: Run, req: ChatCompletionRequest, head: dict[str, Any],
                     tools: ToolMode) -> Response:
        choices = [Choice() for _ in range(req.n)]
        scored = None
        async with aclosing(self.outputs(run)) as outputs:
            async for _, d in outputs:
                scored = d.prompt_logprobs or scored
                for c in d.outputs:
                    choices[c.index].add(c)
        parser = self.state.reasoning_parser
        tok = TokenText(self.state.tokenizer)
        top_n = req.top_logprobs or 0
        out = []
        for j, ch in enumerate(choices):
            reasoning, answer = split_reasoning(parser, ch.text)
            content, calls = tools.parse(answer)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if parser is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = tool_calls_json(calls)
            out.append({"index": j, "message": message,
                        "logprobs": (_logprobs(tok, ch.token_ids, ch.logprobs, top_n)
                                     if req.logprobs else None),
                        "finish_reason": _finish_reason(ch.finish_reason, bool(calls))})
        return JSONResponse({**head, "choices": out, "usage": run.usage(),
                             "system_fingerprint": None,
                             **({"prompt_logprobs": vllm_prompt_logprobs(scored)}
                                if req.prompt_logprobs is not None else {})})

    async def _choice_deltas(self, run: Run, req: ChatCompletionRequest,
                             tools: ToolMode) -> AsyncIterator[dict[str, Any]]:
        """The choices of the chunks: each choice's role first, then its reasoning, content and
        tool-call deltas as the engine's deltas come."""
        tok = TokenText(self.state.tokenizer)
        top_n = req.top_logprobs or 0

        def choice(index: int, delta: dict[str, Any], finish_reason: str | None = None,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}

        for j in range(req.n):
            yield choice(j, {"role": "assistant",
                             "content": "" if tools.kind != "named" else None})
        streams = [ToolStream(tools) for _ in range(req.n)] if tools.kind is not None else None
        thoughts = [ReasoningStream(self.state.reasoning_parser) for _ in range(req.n)]
        async with aclosing(self.outputs(run)) as outputs:
            async for _, d in outputs:
                for c in d.outputs:
                    if not c.text and c.finish_reason is None and not c.token_ids:
                        continue
                    lp = _logprobs(tok, c.token_ids, c.logprobs or [], top_n) if req.logprobs \
                        else None
                    reasoning, text = thoughts[c.index].feed(c.text, c.finish_reason is not None)
                    if reasoning:
                        yield choice(c.index, {"reasoning_content": reasoning}, None, lp)
                        lp = None
                        if not text and c.finish_reason is None:
                            continue
                    if streams is None:
                        yield choice(c.index, {"content": text} if text else {},
                                     c.finish_reason, lp)
                        continue
                    for event in _tool_stream_chunks(streams[c.index], text, c.finish_reason):
                        yield choice(c.index, *event, lp)
                        lp = None


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _chars(message: dict[str, Any]) -> int:
    """The characters of a message a chat template may render: its content, name, tool-call
    id, and its tool calls' ids, names and arguments."""
    calls = message.get("tool_calls") or ()
    return (sum(len(v) for k, v in message.items() if k != "role" and isinstance(v, str))
            + sum(len(c.get("id") or "") + len(c["function"]["name"])
                  + len(c["function"]["arguments"]) for c in calls))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


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
