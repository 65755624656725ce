"""Proposer: what the scheduler asks for a sequence's speculative tokens."""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``token_ids`` (possibly none)."""
        ...
