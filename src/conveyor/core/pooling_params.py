"""PoolingParams: how a pooling request (an embedding) turns a prompt's hidden states into one
vector. Validated on construction.

A pooling request is prefilled like any prompt and finishes when its last prompt token is
computed: nothing is sampled and its KV blocks are freed then (full blocks stay in the prefix
cache). ``mean`` and ``cls`` read the hidden state of every prompt position (or the first), so
such a request takes no prefix-cache hits; ``last`` reads only the last one and takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """``method``: ``last`` (the last token's hidden state, for decoder models), ``mean`` (the
    average over the prompt) or ``cls`` (the first token's); None: the model's own choice (its
    sentence-transformers pooling config) or the server's ``--pooling``.
    ``normalize``: scale the vector to unit length; None: the model's choice (True unless a
    sentence-transformers config without a Normalize module says otherwise).
    ``dimensions``: keep the first N dimensions (before normalizing), for models trained with
    Matryoshka representation learning; None: all of them.
    """

    method: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(f"PoolingParams.method must be one of "
                             f"{', '.join(map(repr, POOLING_METHODS))} or None, got {self.method!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be a bool or None, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"PoolingParams.dimensions must be an integer >= 1 or None, got {d!r}")

    @property
    def needs_every_position(self) -> bool:
        """Reads hidden states before the last token: every prompt position is computed."""
        return self.method in ("mean", "cls")
