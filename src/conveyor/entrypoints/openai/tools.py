"""Function calling on /v1/chat/completions: ``tools`` and ``tool_choice``.

* ``none`` (or no tools): the tools are not shown to the model; plain chat.
* ``auto``: the tools go through the model's chat template (``tools=``); a template without tool
  support gets them in its system message instead (``fallback_tool_prompt``), asking for the
  SmolLM2 format. The reply is parsed by its family's parser (``tool_parsers``) into
  ``tool_calls``; streamed, text is sent as it comes until a call may be starting, and the calls
  are sent whole when the reply ends.
* ``required`` and a named function: enforced with a JSON schema (structured outputs). Named:
  the reply is that function's arguments object, streamed as argument deltas. Required: the
  reply is a list of ``{"name", "arguments"}`` of the given tools.

A reply with tool calls finishes with ``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from conveyor.core.structured_outputs_params import StructuredOutputsParams
from conveyor.entrypoints.openai.tool_parsers import (
    CALL_MARKERS,
    PARSERS,
    ToolCall,
    template_family,
)

FALLBACK_INSTRUCTIONS = (
    "You can call functions. To call one or more, reply with only "
    '<tool_call>[{"name": <function name>, "arguments": <arguments object>}]</tool_call>. '
    "The functions:\n")


def fallback_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-message text that presents ``tools`` to a template without tool support."""
    return FALLBACK_INSTRUCTIONS + "\n".join(json.dumps(t["function"], ensure_ascii=False)
                                             for t in tools)


def _with_calls_in_content(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool calls written into its content, as the fallback format."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    items = []
    for call in calls:
        fn = call.get("function", {})
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = fn.get("arguments")
        items.append({"name": fn.get("name"), "arguments": arguments})
    text = "<tool_call>" + json.dumps(items, ensure_ascii=False) + "</tool_call>"
    return {**message, "content": (message["content"] + "\n" if message["content"] else "") + text}


def _supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


@dataclass
class ToolMode:
    """How one chat request uses its tools (``kind`` None: it does not)."""

    kind: str | None  # None, "auto", "required" or "named"
    tools: list[dict[str, Any]]
    family: str
    named: str | None = None

    @classmethod
    def of(cls, req: Any, chat_template: str | None, parser: str | None = None) -> ToolMode:
        """``parser``: the format to parse (``--tool-call-parser``); None: the template's."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise ValueError("tool_choice needs 'tools'")
        family = parser or template_family(chat_template)
        if choice == "none":
            return cls(None, [], family)
        if isinstance(choice, str):
            return cls(choice, tools, family)
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is "
                             f"not among the tools ({', '.join(names)})")
        return cls("named", tools, family, choice.function.name)

    def _parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object"}

    def constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            return StructuredOutputsParams(json=self._parameters(self.named))
        if self.kind == "required":
            calls = [{"type": "object", "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": self._parameters(t["function"]["name"])},
                "required": ["name", "arguments"]} for t in self.tools]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                                 "items": {"anyOf": calls}})
        return None

    def prompt_messages(self, messages: list[dict[str, Any]],
                        chat_template: str | None) -> tuple[list[dict[str, Any]], Any]:
        """(messages, tools for the template): the template's own tool rendering when it has
        one, else the fallback system message."""
        if self.kind is None:
            return messages, None
        if _supports_tools(chat_template):
            return messages, self.tools
        messages = [_with_calls_in_content(m) for m in messages]
        text = fallback_tool_prompt(self.tools)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            return [first, *messages[1:]], None
        return [{"role": "system", "content": text}, *messages], None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and tool calls."""
        if self.kind == "named":
            return None, [ToolCall(self.named, text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text or None, []  # cut short (max_tokens): no complete call
            return None, [ToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False))
                          for i in items]
        if self.kind == "auto":
            return PARSERS[self.family](text, self.tools)
        return text, []


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def new_call_id(prefix: str = "call") -> str:
    """A fresh tool-call id (OpenAI's start with ``call_``, Anthropic's with ``toolu_``)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """One choice's streamed reply under a ToolMode: ``feed`` each text delta and send the
    message deltas it returns; ``finish`` returns the last ones and whether calls were made."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.holding = False  # a call may have started: keep the rest until the end
        self.call_id = new_call_id()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        mode = self.mode
        first = not self.text and self.sent == 0
        self.text += delta
        if mode.kind == "named":
            head = ({"id": self.call_id, "type": "function",
                     "function": {"name": mode.named, "arguments": ""}} if first else None)
            out = [{"tool_calls": [head]}] if head is not None else []
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            for d in out:
                d["tool_calls"][0]["index"] = 0
            return out
        if mode.kind == "required" or self.holding:
            return []
        if mode.kind is None:
            return self._send(len(self.text))
        return self._send(self._safe_end())

    def _safe_end(self) -> int:
        """How much of the text can be sent as content: up to where a call may begin."""
        text = self.text
        markers = CALL_MARKERS[self.mode.family]
        stripped = text.lstrip()
        if self.mode.family == "llama3" and stripped and stripped[0] == "{":
            self.holding = True
            return self.sent
        cut = len(text)
        for marker in markers:
            if marker == "{":
                continue
            at = text.find(marker)
            if at >= 0:
                self.holding = True
                cut = min(cut, at)
                continue
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's beginning
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut

    def _send(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:end], end
        return [{"content": piece}]

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        mode = self.mode
        if mode.kind == "named":
            return [], True
        content, calls = mode.parse(self.text)
        if not calls:
            return self._send(len(self.text)), False
        out = []
        sent_text = self.text[:self.sent]
        sent = sent_text.strip()
        rest = content[len(sent):] if content and content.startswith(sent) else ""
        trailing = sent_text[len(sent_text.rstrip()):]  # already sent before the first call
        if sent and trailing and rest.startswith(trailing):
            rest = rest[len(trailing):]
        if rest.strip():
            out.append({"content": rest})
        out += [{"tool_calls": [{**call, "index": k}]}
                for k, call in enumerate(tool_calls_json(calls))]
        return out, True
