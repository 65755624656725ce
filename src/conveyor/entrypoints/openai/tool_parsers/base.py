"""What every tool-call parser shares: the ``ToolCall`` it returns, turning a decoded
``{"name", "arguments"|"parameters"}`` object into one, and the content left around the calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


# A parser: (the reply's text, the request's tools) -> (content, calls). Content is the text
# outside the calls (None when empty); text that does not parse as a call stays content.
Parser = Callable[[str, "list[dict[str, Any]] | None"], "tuple[str | None, list[ToolCall]]"]


def arguments_json(args: Any) -> str | None:
    """The JSON text of an arguments object (a JSON string of one is decoded first); None
    when it is not an object."""
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def call_from(obj: Any) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> a ToolCall (None: not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = arguments_json(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else ToolCall(obj["name"], args)


def calls_from(obj: Any) -> list[ToolCall] | None:
    """One call or a list of calls (None unless every item is one)."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from(item) for item in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[misc]


def content(text: str) -> str | None:
    """The content of the text around the calls (the pieces joined as they were)."""
    text = text.strip()
    return text or None


def parameter_schema(tools: list[dict[str, Any]] | None, name: str,
                     parameter: str) -> dict[str, Any]:
    """The JSON schema of one parameter of the named tool ({} when unknown)."""
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            schema = props.get(parameter)
            return schema if isinstance(schema, dict) else {}
    return {}
