"""Proposer: what the scheduler asks for a sequence's speculative tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from conveyor.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``seq.token_ids`` (possibly none). The slots of
        positions ``len(seq.token_ids) - 1`` .. ``+ k`` are in ``seq.block_table`` already (a
        draft model writes its own K/V there)."""
        ...
