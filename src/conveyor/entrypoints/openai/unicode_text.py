"""Text a request carries must be Unicode that encodes. JSON's ``\\uXXXX`` escapes can spell a
lone UTF-16 surrogate (``"\\ud800"``): Python's JSON parser keeps it in a ``str``, but no
tokenizer, chat template or UTF-8 response can take it. ``check_text`` finds the first such
string of a parsed body (a value or an object key, nested anywhere) and makes it a 400 naming
its field, before anything else reads the body; with ``--invalid-unicode replace`` each lone
surrogate becomes U+FFFD (the replacement character) instead. The raw body's escapes are looked
at first, so a body without a surrogate escape costs one regular-expression scan."""

from __future__ import annotations

import re
from typing import Any

from conveyor.entrypoints.openai.errors import APIError, bad_request

INVALID_UNICODE_MODES = ("reject", "replace")
# A lone surrogate can only come from an escape: the body was decoded as strict UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN = 64  # characters of a field name shown in a message


def _bad_at(text: str) -> int | None:
    """Where ``text`` first holds a character UTF-8 cannot encode (None: nowhere)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _where(path: list[str | int]) -> str:
    return ".".join(str(p)[:_SHOWN] for p in path)


def _error(path: list[str | int], text: str, at: int, is_key: bool) -> APIError:
    what = (f"a field name in '{_where(path)}'" if is_key and path else
            "a field name" if is_key else f"'{_where(path)}'")
    return bad_request(f"{what} is not valid Unicode text: it holds a lone UTF-16 surrogate "
                       f"(\\u{ord(text[at]):04x}) at character {at}. Send UTF-8 text, or "
                       "start the server with --invalid-unicode replace.",
                       param=str(path[0])[:_SHOWN] if path else None, code="invalid_unicode")


def _first_bad(value: Any, path: list[str | int]) -> APIError | None:
    if isinstance(value, str):
        at = _bad_at(value)
        return None if at is None else _error(path, value, at, False)
    if isinstance(value, dict):
        for key, child in value.items():
            at = _bad_at(key)
            if at is not None:
                return _error(path, key, at, True)
            if (err := _first_bad(child, [*path, key])) is not None:
                return err
    elif isinstance(value, list):
        for i, child in enumerate(value):
            if (err := _first_bad(child, [*path, i])) is not None:
                return err
    return None


def _replaced(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replaced(v) for v in value]
    return value


def check_text(raw: str, body: dict[str, Any], mode: str = "reject") -> dict[str, Any]:
    """``body`` (parsed from ``raw``, its nesting already bounded) when all its text encodes;
    otherwise a 400 naming the first field that does not (``mode`` "reject"), or the body with
    each lone surrogate replaced (``mode`` "replace")."""
    if not _SURROGATE_ESCAPE.search(raw):
        return body
    return check_value(body, mode)


def check_value(value: Any, mode: str = "reject", path: list[str | int] | None = None) -> Any:
    """``check_text`` of text that came without a JSON source to scan first (a form field, an
    object parsed elsewhere): a 400 naming the first string that does not encode (``path``:
    where ``value`` sits), or (``mode`` "replace") ``value`` with each lone surrogate replaced."""
    if mode == "replace":
        return _replaced(value)
    err = _first_bad(value, path or [])
    if err is not None:
        raise err
    return value
