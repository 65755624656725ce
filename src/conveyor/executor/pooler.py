"""Pooler: the vectors of pooling requests (embeddings), from the final-norm hidden states.

For each pooling entry of a step the executor asks the model for the hidden states its method
reads (``rows``): the last prompt token (``last``), the first (``cls``) or every one (``mean``).
A prompt computed over several chunks keeps a running float32 sum between steps; the chunk that
completes the prompt yields the vector: truncated to ``dimensions``, then normalized if asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.core.sequence import Sequence


@dataclass(slots=True)
class PoolingEntry:
    entry: int  # index in the SchedulerOutput
    seq: Sequence
    first_row: int  # flat index of the chunk's first token in the step
    start: int  # position of that token in the prompt
    count: int  # tokens computed this step

    @property
    def completes(self) -> bool:
        return self.start + self.count == len(self.seq.token_ids)

    def rows(self) -> range:
        """The chunk's flat rows whose hidden states its method reads."""
        method = self.seq.group.pooling_params.method
        if method == "mean":
            return range(self.first_row, self.first_row + self.count)
        if method == "cls":
            return range(self.first_row, self.first_row + 1 if self.start == 0 else self.first_row)
        return range(self.first_row + self.count - 1, self.first_row + self.count) \
            if self.completes else range(0)


class Pooler:
    def __init__(self) -> None:
        # seq id -> (sequence, float32 sum or first hidden state) for prompts part-way computed
        self._partial: dict[int, tuple[Sequence, torch.Tensor]] = {}

    @staticmethod
    def rows(entries: list[PoolingEntry]) -> list[int]:
        return [r for e in entries for r in e.rows()]

    def pool(self, entries: list[PoolingEntry],
             hidden: torch.Tensor | None) -> dict[int, list[float]]:
        """``hidden``: float32 rows in the order of ``rows(entries)`` (None: there were none);
        the vectors of the entries whose prompt this step completed, by entry index."""
        self._forget_finished()
        out: dict[int, list[float]] = {}
        at = 0
        for e in entries:
            n = len(e.rows())
            mine = hidden[at:at + n] if n else None
            at += n
            params = e.seq.group.pooling_params
            sid = e.seq.seq_id
            if e.start == 0:  # a first chunk, or a prompt recomputed after a preemption
                self._partial.pop(sid, None)
            if params.method == "mean":
                total = mine.sum(dim=0)
                held = self._partial.get(sid)
                if held is not None:
                    total += held[1]
            elif params.method == "cls":
                total = mine[0] if n else self._partial[sid][1]
            else:
                total = mine[0] if n else None
            if not e.completes:
                if total is not None:
                    self._partial[sid] = (e.seq, total)
                continue
            self._partial.pop(sid, None)
            vector = total / len(e.seq.token_ids) if params.method == "mean" else total
            if params.dimensions is not None:
                vector = vector[:params.dimensions]
            if params.normalize:
                vector = F.normalize(vector, dim=0)
            out[e.entry] = vector.tolist()
        return out

    def _forget_finished(self) -> None:
        """Drop the sums of requests that ended part-way (aborted, preempted then finished)."""
        for sid in [sid for sid, (seq, _) in self._partial.items() if seq.status.is_finished]:
            del self._partial[sid]
