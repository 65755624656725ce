"""``pythonic`` tool calls (Llama 3.2's and Llama 4's templates): a Python list of calls with
keyword arguments, ``[get_weather(city="Paris", units={"temp": "C"}), get_time()]``, optionally
between ``<|python_start|>`` and ``<|python_end|>``. Argument values are Python (or JSON)
literals: strings, numbers, ``True``/``true``, ``None``/``null``, lists and dicts nested."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from conveyor.entrypoints.openai.tool_parsers.base import ToolCall, content

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_OPEN = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        return None
    try:
        args = {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError):
        return None
    if len(args) != len(node.keywords):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _calls_at(text: str, start: int) -> tuple[list[ToolCall], int] | None:
    """The list of calls that opens at ``start`` and the index after its ``]`` (None: none)."""
    end = text.find("]", start)
    while end >= 0:
        try:
            tree = ast.parse(text[start:end + 1], mode="eval").body
        except SyntaxError:
            end = text.find("]", end + 1)
            continue
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_call(e) for e in tree.elts]
        if any(c is None for c in calls):
            return None
        return calls, end + 1  # type: ignore[return-value]
    return None


def parse_pythonic(text: str, tools: list[dict[str, Any]] | None = None
                   ) -> tuple[str | None, list[ToolCall]]:
    body = text.replace(PYTHON_START, "").replace(PYTHON_END, "")
    calls: list[ToolCall] = []
    kept = []
    pos = 0
    for m in _OPEN.finditer(body):
        if m.start() < pos:
            continue
        found = _calls_at(body, m.start())
        if found is None:
            continue
        kept.append(body[pos:m.start()])
        calls += found[0]
        pos = found[1]
    kept.append(body[pos:])
    return (content("".join(kept)), calls) if calls else (content(text), [])
