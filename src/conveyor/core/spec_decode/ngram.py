"""N-gram (prompt lookup) proposer: no model, only the sequence's own tokens.

For n from ``max_n`` down to ``min_n``: find the latest earlier occurrence of the sequence's
last n tokens in its prompt + output; the k tokens that followed it are the proposal.
The search is one vectorised comparison over every window of the sequence (numpy).
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def follow(self, step: object) -> None:
        """Nothing to compute per step: the lookup reads only the tokens."""

    def propose(self, contexts: list[list[int]], block_tables: list[list[list[int]]],
                k: int) -> list[list[int]]:
        return [self.lookup(tokens, k) for tokens in contexts]

    def lookup(self, token_ids: Tokens[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``token_ids`` (empty when no n-gram recurs)."""
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                return _copy(tokens.tolist(), int(hits[-1]) + n, k)
        return []


def _copy(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on, running into the copy itself past the end (an
    overlapping copy, as LZ77's): a match close to the end means a short repeating period."""
    out = tokens[start:start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period] if len(out) >= period else tokens[start + len(out)])
    return out
