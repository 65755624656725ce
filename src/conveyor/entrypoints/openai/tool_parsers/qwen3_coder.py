"""``qwen3_coder`` tool calls (Qwen3-Coder's XML format), one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text becomes the type its tool's schema gives it (string, integer, number,
boolean, object, array); without a schema, JSON text is decoded and anything else stays a
string. One newline right inside each ``<parameter=...>`` tag is the format's, not the value's."""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.entrypoints.openai.tool_parsers.base import ToolCall, content, parameter_schema

_BLOCK = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>(?:\s*</tool_call>)?",
                    re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


_IS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
       "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
       "array": lambda v: isinstance(v, list), "null": lambda v: v is None,
       "string": lambda v: False}  # a string value is the raw text itself


def _typed(raw: str, schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if kinds == ["string"]:
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if not kinds or any(_IS.get(k, lambda v: True)(value) for k in kinds):
        return value
    return raw


def _strip_newline(raw: str) -> str:
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None
                      ) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept = []
    end = 0
    for m in _BLOCK.finditer(text):
        name = m.group(1).strip()
        args = {p.group(1).strip(): _typed(_strip_newline(p.group(2)),
                                           parameter_schema(tools, name, p.group(1).strip()))
                for p in _PARAM.finditer(m.group(2))}
        kept.append(text[end:m.start()])
        end = m.end()
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    kept.append(text[end:])
    return (content("".join(kept)), calls) if calls else (content(text), [])
