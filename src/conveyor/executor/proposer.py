"""Proposer: what ``ModelRunner.propose`` asks after each step for the tokens the scheduler
verifies in the next (``draft_proposer.py``, ``core/spec_decode/ngram.py``)."""

from __future__ import annotations

from typing import Protocol

from conveyor.core.step_input import StepInput


class Proposer(Protocol):
    def follow(self, step: StepInput) -> None:
        """Compute ``step`` (its block operations and tokens) where the proposer keeps state."""

    def propose(self, contexts: list[list[int]], block_tables: list[list[list[int]]],
                k: int) -> list[list[int]]:
        """Up to ``k`` tokens likely to follow each of ``contexts`` (possibly none); each
        sequence's ``block_tables`` row holds its block table in every KV-cache group
        (``seq.block_tables``), the slots of its positions."""
