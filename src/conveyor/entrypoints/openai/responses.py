"""OpenAI's Responses API (``POST /v1/responses``), stateless, on the chat path: ``instructions``
and ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items) become
chat messages, ``tools`` / ``tool_choice`` the chat's function tools and ``text.format`` its
``response_format``; the request runs through ``start_chat`` (same limits, admission and engine)
and the reply becomes output items (``reasoning`` with ``--reasoning-parser``, ``message``,
``function_call``), whole or as the Responses stream of events. No response is kept, so
``store: true``, ``previous_response_id`` and ``conversation`` are a 400. Errors take OpenAI's
shape, naming this API's fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from conveyor.entrypoints.openai.chat import OpenAIServingChat, chat_request_from
from conveyor.entrypoints.openai.errors import APIError, bad_request
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.reasoning_parsers import ReasoningStream
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.serving import Run, now_s
from conveyor.entrypoints.openai.sse import sse_event
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream, new_call_id

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.state import ServerState


class TextContent(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output part sent back: not part of the prompt
    logprobs: list[Any] | None = None


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    id: str | None = None  # an earlier response's output item sent back
    status: str | None = None


class FunctionCallItem(RequestModel):
    """A function call the model made earlier (from an earlier response's output)."""

    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]
    id: str | None = None
    status: str | None = None


class ReasoningItem(RequestModel):
    """An earlier response's reasoning: accepted, and left out of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # the API's; changes nothing here


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # only false: no response is kept
    previous_response_id: str | None = None  # refused: no response is kept
    conversation: str | dict[str, Any] | None = None  # refused: no conversation is kept
    metadata: dict[str, str] | None = None
    user: str | None = None
    # the API's fields that change nothing on this server, accepted so that SDK clients work
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _check_stateless(req: ResponsesRequest) -> None:
    kept = "this server keeps no responses (its Responses API is stateless)"
    if req.store:
        raise bad_request(f"'store': true is not supported: {kept}; send 'store': false or "
                          "leave it out", param="store")
    for field in ("previous_response_id", "conversation"):
        if getattr(req, field) is not None:
            raise bad_request(f"'{field}' is not supported: {kept}; send the whole "
                              "conversation as 'input' items", param=field)


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) \
        else req.input
    for item in items:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # the calls of one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
    if not out:
        raise bad_request("'input' must contain at least one message", param="input")
    return out


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("'text.format.schema' is required when text.format.type is "
                          "'json_schema'", param="text.format")
    schema = {"name": fmt.name or "response", "description": fmt.description,
              "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                   if v is not None}}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that runs ``req``."""
    choice = req.tool_choice
    body: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "user": req.user, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                        if isinstance(choice, FunctionChoice) else choice)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                         exclude_none=True)}
                         for t in req.tools]
    return chat_request_from(body)


# the chat request's fields that errors from the chat path name, as this API calls them
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


def _renamed(err: APIError) -> APIError:
    if err.param not in _FIELDS:
        return err
    message = err.message
    if err.param == "max_tokens":
        message = message.replace("max_tokens", "max_output_tokens")
    return APIError(err.status, message, _FIELDS[err.param], err.code, err.headers)


def _part(kind: str, text: str) -> dict[str, Any]:
    """The content part of a reasoning or message item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Reply:
    """The response as the engine's deltas come: output items (the last one open while its text
    grows), each step's stream events (numbered), and the response object."""

    def __init__(self, state: ServerState, req: ResponsesRequest, run: Run,
                 tools: ToolMode) -> None:
        self.req, self.run = req, run
        self.model = req.model or state.model_names[0]
        self.created = now_s()
        self.thoughts = ReasoningStream(state.reasoning_parser)
        self.tools = ToolStream(tools)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item whose text still grows
        self.text = ""  # the open reasoning or message item's text so far
        self.sequence_number = 0
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None

    def event(self, kind: str, **data: Any) -> str:
        self.sequence_number += 1
        return sse_event(kind, {**data, "sequence_number": self.sequence_number - 1})

    def error(self, err: APIError) -> str:
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def feed(self, text: str, num_tokens: int, finish_reason: str | None) -> list[str]:
        """The events of one engine delta of the reply (the last has a finish reason)."""
        if self.thoughts.in_reasoning:
            self.reasoning_tokens += num_tokens
        last = finish_reason is not None
        reasoning, answer = self.thoughts.feed(text, last)
        out = self._text("reasoning", reasoning)
        pieces = self.tools.feed(answer) if answer or last else []
        if last:
            pieces += self.tools.finish()[0]
        for piece in pieces:
            if "content" in piece:
                out += self._text("message", piece["content"] or "")
            for call in piece.get("tool_calls", []):
                out += self._call(call)
        if last:
            self.finish_reason = finish_reason  # the item still open ends with the reply
            out += self._close()
        return out

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=dict(item))]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, kind: str, text: str) -> list[str]:
        """Text of a reasoning or message item, opening the item at its first text."""
        if not text:
            return []
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                out += self._add({"type": "reasoning", "id": new_call_id("rs"), "summary": [],
                                  "content": [], "status": "in_progress"})
            else:
                out += self._add({"type": "message", "id": new_call_id("msg"),
                                  "role": "assistant", "content": [], "status": "in_progress"})
            self.text = ""
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=_part(kind, "")))
        self.text += text
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=text))
        else:
            out.append(self.event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A tool-call delta of the chat path: a call's head (with its id) opens a
        function_call item; its arguments come whole or as deltas."""
        out = []
        if "id" in call:
            out += self._close()
            out += self._add({"type": "function_call", "id": new_call_id("fc"),
                              "call_id": call["id"], "name": call["function"]["name"],
                              "arguments": "", "status": "in_progress"})
        delta = call.get("function", {}).get("arguments") or ""
        if delta and self.open is not None:
            self.open["arguments"] += delta
            out.append(self.event("response.function_call_arguments.delta", **self._where(),
                                  delta=delta))
        return out

    def _close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        self.open = None
        ended = self.finish_reason == "length"  # the reply was cut while this item grew
        item["status"] = "incomplete" if ended else "completed"
        if item["type"] == "function_call":
            return [self.event("response.function_call_arguments.done", **where,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=where["output_index"],
                               item=item)]
        part = _part(item["type"], self.text)
        item["content"] = [part]
        done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                else "response.output_text.done")
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self.event(done, **where, content_index=0, text=self.text, **extra),
                self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"],
                           item=item)]

    def response(self, status: str | None = None) -> dict[str, Any]:
        """The response object; ``status`` None: the finished one, with usage."""
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        body: dict[str, Any] = {
            "id": self.run.request_id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": [], "parallel_tool_calls":
                req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "tool_choice": (choice.model_dump() if isinstance(choice, FunctionChoice)
                            else choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}}
        if status is not None:
            return body
        cut = self.finish_reason == "length"
        run = self.run
        reasoning_tokens = self.reasoning_tokens if self.thoughts.has_reasoning else 0
        return {**body, "status": "incomplete" if cut else "completed", "output": self.items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": {"input_tokens": run.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": run.cached_tokens},
                          "output_tokens": run.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                          "total_tokens": run.prompt_tokens + run.output_tokens}}


class OpenAIServingResponses(OpenAIServingChat):
    async def create_response(self, request: Request) -> Response:
        req = await self.parse(request, ResponsesRequest)
        _check_stateless(req)
        try:
            run, tools = await self.start_chat(request, chat_request(req), "resp")
        except APIError as e:
            raise _renamed(e) from e
        reply = _Reply(self.state, req, run, tools)
        if req.stream:
            return self.stream_response(run, self._events(reply))
        return await self.full_response(request, run, self._whole(reply))

    async def _whole(self, reply: _Reply) -> Response:
        async with aclosing(self.outputs(reply.run)) as outputs:
            async for _, d in outputs:
                for c in d.outputs:
                    reply.feed(c.text, len(c.token_ids), c.finish_reason)
        return JSONResponse(reply.response())

    async def _events(self, reply: _Reply) -> AsyncIterator[str]:
        """response.created and .in_progress, each item's events as its text comes (tool calls
        of an ``auto`` or ``required`` choice once the reply has ended), then
        response.completed (or response.incomplete); an error mid-stream is an ``error`` event
        that ends it."""
        yield reply.event("response.created", response=reply.response("in_progress"))
        yield reply.event("response.in_progress", response=reply.response("in_progress"))
        try:
            async with aclosing(self.outputs(reply.run)) as outputs:
                async for _, d in outputs:
                    for c in d.outputs:
                        for event in reply.feed(c.text, len(c.token_ids), c.finish_reason):
                            yield event
        except Exception as e:
            yield reply.error(self.state.api_error(e))
            return
        final = reply.response()
        yield reply.event(f"response.{final['status']}", response=final)
