"""SpeculativeConfig: which proposer, how many tokens it proposes, and when to turn it off."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` (k): most tokens proposed per sequence and step.

    ``ngram``: the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens are looked up in
    the sequence's own prompt and output; the tokens that followed the latest earlier match are
    the proposal. ``disable_by_batch_size``: nothing is proposed after a step in which more
    sequences than this could propose (``ModelRunner.propose``), and nothing is verified in a
    step with more decodes (``core/lookahead.py``); 0: never disabled. Verification rows then
    cost more than they save.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        owner = "SpeculativeConfig"
        if self.method not in METHODS:
            raise ValueError(f"{owner}.method must be one of {', '.join(map(repr, METHODS))}, "
                             f"got {self.method!r}")
        for name, minimum in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1),
                              ("prompt_lookup_max", 1), ("disable_by_batch_size", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{owner}.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @property
    def drafting_slots(self) -> int:
        """Slots past a decode's step tokens that a draft model writes its proposal's K/V into
        after the step (none for n-gram lookup, which computes nothing)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def enabled_for(self, batch_size: int) -> bool:
        return not self.disable_by_batch_size or batch_size <= self.disable_by_batch_size
