"""``--pd P:D``: how many prefill and how many decode instances a disaggregated fleet runs (the
serving fleet, entrypoints/ray_serve/launcher.py, and the simulator's, sim/pd_fleet.py)."""

from __future__ import annotations


def parse_pd(text: str) -> tuple[int, int]:
    """``P:D`` -> (P, D), both >= 1."""
    p, sep, d = text.strip().partition(":")
    try:
        num_p, num_d = int(p), int(d)
    except ValueError:
        num_p = num_d = 0
    if not sep or num_p < 1 or num_d < 1:
        raise ValueError(f"bad --pd {text!r}: use PREFILL:DECODE instance counts, e.g. 1:1")
    return num_p, num_d
