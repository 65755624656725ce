"""Anthropic's Messages API (``POST /v1/messages``) on the chat path: the request becomes a chat
completion request (system, text, ``tool_use`` and ``tool_result`` blocks become messages and
tool calls; ``tools`` / ``tool_choice`` the chat's function tools), runs through ``start_chat``
with the same limits, admission and engine, and the reply is rendered as Anthropic's message or
its stream of events. With ``--reasoning-parser`` the reasoning comes first as a ``thinking``
block (streamed as ``thinking_delta``); thinking blocks sent back in a conversation are dropped.
Errors on this path take Anthropic's shape (``errors.APIError``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from conveyor.entrypoints.openai.chat import OpenAIServingChat, chat_request_from
from conveyor.entrypoints.openai.errors import bad_request
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.serving import Choice, Run
from conveyor.entrypoints.openai.sse import sse_event
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream, new_call_id

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.tool_parsers import ToolCall


class AnthropicTool(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # no prompt caching to control: accepted


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    # the API's fields that change nothing on this server, accepted so that SDK clients work
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None  # reasoning follows --reasoning-parser


def _text(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}: only text blocks are supported here, got "
                              f"{block.get('type')!r}", param=where)
        parts.append(block["text"])
    return "".join(parts)


def _chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for block in m.content:
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("input"), dict) or not block.get("name"):
                    raise bad_request(f"{where}: a tool_use block needs a name and an object "
                                      "input", param=where)
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # a reply's reasoning is not part of the next prompt
            elif kind == "tool_result" and m.role == "user":
                content = block.get("content", "")
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": _text(content, where)})
            else:
                raise bad_request(f"{where}: content blocks of type {kind!r} are not supported "
                                  f"in a {m.role} message", param=where)
        out += results
        if text or calls or not results:
            message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    named = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in named:
        raise bad_request("tool_choice.type must be auto, any, tool (with a name) or none",
                          param="tool_choice")
    return named[kind]


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that runs ``req``."""
    body: dict[str, Any] = {
        "model": req.model, "messages": _chat_messages(req), "max_tokens": req.max_tokens,
        "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "stream": req.stream, "tool_choice": _tool_choice(req.tool_choice)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    return chat_request_from(body)


def _stop_reason(finish_reason: str | None, stop: int | str | None, called: bool
                 ) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished reply."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


_THINKING = {"type": "thinking", "thinking": "", "signature": ""}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": new_call_id("toolu"), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _usage(run: Run) -> dict[str, int]:
    return {"input_tokens": run.prompt_tokens, "output_tokens": run.output_tokens,
            "cache_read_input_tokens": run.cached_tokens, "cache_creation_input_tokens": 0}


class _Blocks:
    """A reply's content blocks as stream events: a thinking or text block opens with its first
    text and closes when another block opens or the reply ends."""

    def __init__(self) -> None:
        self.index = -1  # the last opened block's
        self.open: str | None = None  # its kind while open

    def text(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if kind != self.open:
            out += self.close()
            self.index += 1
            self.open = kind
            out.append(sse_event("content_block_start", {"index": self.index, "content_block": (
                _THINKING if kind == "thinking" else {"type": "text", "text": ""})}))
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        out.append(sse_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"index": self.index})]

    def tool_use(self, call: ToolCall) -> list[str]:
        out = self.close()
        self.index += 1
        use = _tool_use(call)
        return out + [
            sse_event("content_block_start", {"index": self.index,
                                           "content_block": {**use, "input": {}}}),
            sse_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(use["input"])}}),
            sse_event("content_block_stop", {"index": self.index})]


class AnthropicServingMessages(OpenAIServingChat):
    async def create_message(self, request: Request) -> Response:
        req = await self.parse(request, MessagesRequest)
        run, tools = await self.start_chat(request, chat_request(req), "msg")
        if req.stream:
            return self.stream_response(run, self._events(run, req, tools))
        return await self.full_response(request, run, self._whole(run, req, tools))

    async def _whole(self, run: Run, req: MessagesRequest, tools: ToolMode) -> Response:
        reply = Choice()
        async with aclosing(self.outputs(run)) as outputs:
            async for _, d in outputs:
                for c in d.outputs:
                    reply.add(c)
        reasoning, answer = split_reasoning(self.state.reasoning_parser, reply.text)
        content, calls = tools.parse(answer)
        blocks: list[dict[str, Any]] = [_THINKING | {"thinking": reasoning}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [_tool_use(call) for call in calls]
        stop_reason, stop_sequence = _stop_reason(reply.finish_reason, reply.stop_reason,
                                                  bool(calls))
        return JSONResponse({"id": run.request_id, "type": "message", "role": "assistant",
                             "model": req.model, "content": blocks, "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence, "usage": _usage(run)})

    async def _events(self, run: Run, req: MessagesRequest,
                      tools: ToolMode) -> AsyncIterator[str]:
        """Anthropic's events: thinking and text stream as blocks as they come; tool calls,
        known once the reply has ended, follow as tool_use blocks."""
        yield sse_event("message_start", {"message": {
            "id": run.request_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(run)}})
        stream = ToolStream(tools)
        thoughts = ReasoningStream(self.state.reasoning_parser)
        blocks = _Blocks()
        reply = Choice()

        def text_events(pieces: list[dict[str, Any]]) -> list[str]:
            return [e for piece in pieces for e in blocks.text("text", piece.get("content") or "")]

        try:
            async with aclosing(self.outputs(run)) as outputs:
                async for _, d in outputs:
                    for c in d.outputs:
                        reply.add(c)
                        reasoning, text = thoughts.feed(c.text, c.finish_reason is not None)
                        for event in (blocks.text("thinking", reasoning)
                                      + text_events(stream.feed(text) if text else [])):
                            yield event
        except Exception as e:
            error = self.state.api_error(e).anthropic_body()["error"]
            yield sse_event("error", {"error": error})
            return
        rest, _ = stream.finish()
        for event in text_events([piece for piece in rest if "content" in piece]):
            yield event
        _, calls = tools.parse(stream.text)
        for event in blocks.close() + [e for call in calls for e in blocks.tool_use(call)]:
            yield event
        stop_reason, stop_sequence = _stop_reason(reply.finish_reason, reply.stop_reason,
                                                  bool(calls))
        yield sse_event("message_delta", {"delta": {"stop_reason": stop_reason,
                                                 "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": run.output_tokens,
                                                 "cache_read_input_tokens": run.cached_tokens}})
        yield sse_event("message_stop", {})
