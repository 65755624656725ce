"""Tool calls written as JSON objects.

* ``hermes`` (Qwen2, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
* ``smollm2`` (SmolLM2's function-calling format, and the fallback prompt of templates without
  tool support): ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``;
* ``llama3`` (Llama 3.1+): ``{"name": ..., "parameters": {...}}`` as the whole reply, optionally
  after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls (v3 tokenizers), or then
  ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11+ tokenizers, where
  ``[CALL_ID]id`` may sit before ``[ARGS]``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.entrypoints.openai.tool_parsers.base import (
    ToolCall,
    arguments_json,
    call_from,
    calls_from,
    content,
)

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*[\w\-]+\s*)?\[ARGS\]")


def parse_tagged(text: str, tools: list[dict[str, Any]] | None = None
                 ) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>`` blocks holding one call or a list of calls (hermes and smollm2)."""
    calls: list[ToolCall] = []
    kept = []
    end = 0
    for m in _BLOCK.finditer(text):
        try:
            found = calls_from(json.loads(m.group(1)))
        except json.JSONDecodeError:
            found = None
        if found is None:
            continue
        kept.append(text[end:m.start()])
        end = m.end()
        calls += found
    kept.append(text[end:])
    return (content("".join(kept)), calls) if calls else (content(text), [])


def parse_llama3(text: str, tools: list[dict[str, Any]] | None = None
                 ) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return content(text), []
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return content(text), []
        call = call_from(obj)
        if call is None:
            return content(text), []
        calls.append(call)
        pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
    return None, calls


def _mistral_calls(body: str) -> tuple[list[ToolCall], int] | None:
    """The calls right after one ``[TOOL_CALLS]`` and where they end (None: not calls)."""
    decoder = json.JSONDecoder()
    named = _MISTRAL_NAMED.match(body)
    try:
        if named is not None:
            args, end = decoder.raw_decode(body, named.end())
            arguments = arguments_json(args)
            return (None if arguments is None
                    else ([ToolCall(named.group(1), arguments)], end))
        start = len(body) - len(body.lstrip())
        obj, end = decoder.raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    calls = calls_from(obj)
    return None if calls is None else (calls, end)


def parse_mistral(text: str, tools: list[dict[str, Any]] | None = None
                  ) -> tuple[str | None, list[ToolCall]]:
    pieces = text.split(MISTRAL_CALLS)
    kept = [pieces[0]]
    calls: list[ToolCall] = []
    for piece in pieces[1:]:
        found = _mistral_calls(piece)
        if found is None:
            kept.append(MISTRAL_CALLS + piece)
            continue
        calls += found[0]
        kept.append(piece[found[1]:])
    return (content("".join(kept)), calls) if calls else (content(text), [])
