"""Stop strings: find them in generated text, wherever token boundaries fall.

The engine appends each detokenized delta to a sequence's text and asks ``find_stop_string``
whether a stop string now occurs in a position that touches the new text. While a sequence
is still running, ``partial_stop_len`` says how much of the text's tail could be the start of
a stop string; that tail is held back from streamed output so a stop string never leaks out
half-printed.
"""

from __future__ import annotations


def find_stop_string(text: str, new_text_start: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest ``(index, stop)`` whose match ends at or after ``new_text_start``, else None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_text_start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def truncate_at_stop(text: str, index: int, stop: str, include_stop_str: bool) -> str:
    """The final text of a sequence stopped by ``stop`` found at ``index``."""
    return text[: index + len(stop)] if include_stop_str else text[:index]
