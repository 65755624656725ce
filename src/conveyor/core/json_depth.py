"""How deep a parsed JSON value nests: checked before recursive code (validators, compilers)
walks a value from a client, so that depth is an error message, never a RecursionError."""

from __future__ import annotations

from typing import Any


def json_depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether ``obj`` (parsed JSON) nests lists/objects deeper than ``limit``; iterative, and it
    stops at the first container too deep."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False
