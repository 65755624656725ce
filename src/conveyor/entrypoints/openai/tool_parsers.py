"""Tool calls in a model's text, one parser per chat-template family.

* ``hermes`` (Qwen2, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``smollm2`` (SmolLM2's function-calling format, and the fallback prompt of templates without
  tool support): ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``;
* ``llama3`` (Llama 3.1+): ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally
  after ``<|python_tag|>``, several separated by ``;``.

Each parser returns the text outside the calls (None when empty) and the calls found; text
that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(obj: Any) -> list[ToolCall] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(item) for item in items]
    return None if not calls or any(c is None for c in calls) else calls


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


def parse_tagged(text: str) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>`` blocks holding one call or a list of calls (hermes and smollm2)."""
    calls: list[ToolCall] = []
    kept = []
    end = 0
    for m in _BLOCK.finditer(text):
        try:
            found = _calls(json.loads(m.group(1)))
        except json.JSONDecodeError:
            found = None
        if found is None:
            continue
        kept.append(text[end:m.start()])
        end = m.end()
        calls += found
    kept.append(text[end:])
    return (_content("".join(kept)), calls) if calls else (_content(text), [])


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return _content(text), []
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return _content(text), []
        call = _call(obj)
        if call is None:
            return _content(text), []
        calls.append(call)
        pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
    return None, calls


PARSERS = {"hermes": parse_tagged, "smollm2": parse_tagged, "llama3": parse_llama3}
# The text that opens a call in each family (llama3: the reply itself starts with "{").
CALL_MARKERS = {"hermes": ("<tool_call>",), "smollm2": ("<tool_call>",),
                "llama3": (PYTHON_TAG, "{")}


def template_family(chat_template: str | None) -> str:
    """Which format a chat template's model calls tools in (smollm2 for templates without
    tool support: the fallback prompt asks for that format)."""
    template = chat_template or ""
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    if "<tool_call>" in template and "tools" in template:
        return "hermes"
    return "smollm2"
