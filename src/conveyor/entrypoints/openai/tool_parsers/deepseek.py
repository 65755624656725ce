"""``deepseek_v3`` tool calls (DeepSeek-V3, -R1 and -V3.1's templates): a block of calls between
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each call between
``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>`` in one of two shapes:

* V3/R1: ``function<｜tool▁sep｜>NAME`` then the arguments in a ```` ```json ```` fence;
* V3.1: ``NAME<｜tool▁sep｜>`` then the arguments object.
"""

from __future__ import annotations

import json
import re
from typing import Any

from conveyor.entrypoints.openai.tool_parsers.base import ToolCall, arguments_json, content

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)"
                   + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"([^\n`]+?)\s*\n?```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)
_BLOCK = re.compile(r"(?:" + re.escape(CALLS_BEGIN) + r")?((?:\s*" + _CALL.pattern + r")+)\s*(?:"
                    + re.escape(CALLS_END) + r")?", re.DOTALL)


def _call(head: str, body: str) -> ToolCall | None:
    head = head.strip()
    if head in ("", "function"):  # V3: the name heads the body, the arguments are fenced
        fenced = _FENCED.match(body.strip())
        if fenced is None:
            return None
        name, args = fenced.group(1).strip(), fenced.group(2)
    else:
        name, args = head, body
    try:
        arguments = arguments_json(json.loads(args))
    except json.JSONDecodeError:
        return None
    return None if arguments is None or not name else ToolCall(name, arguments)


def parse_deepseek_v3(text: str, tools: list[dict[str, Any]] | None = None
                      ) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept = []
    end = 0
    for block in _BLOCK.finditer(text):
        found = [_call(m.group(1), m.group(2)) for m in _CALL.finditer(block.group(1))]
        if not found or any(c is None for c in found):
            continue
        kept.append(text[end:block.start()])
        end = block.end()
        calls += found  # type: ignore[arg-type]
    kept.append(text[end:])
    return (content("".join(kept)), calls) if calls else (content(text), [])
