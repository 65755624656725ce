"""SchedulerStats: a read-only snapshot of the scheduler's queues, KV usage and counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int = 0  # sequences holding KV blocks and being computed (decoding or mid-prefill)
    num_waiting: int = 0  # sequences waiting to be (re)prefilled
    num_swapped: int = 0  # sequences whose KV blocks sit in the CPU pool
    num_free_blocks: int = 0  # GPU blocks free or holding evictable cached prefixes
    num_total_blocks: int = 0
    kv_usage: float = 0.0  # fraction of GPU blocks in use, in [0, 1]
    num_preemptions: int = 0  # total since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens whose computation was really skipped
    spec_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verifications: int = 0  # decodes that verified a proposal

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 before any proposal)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying decode produces on average: its accepted proposal + 1."""
        if not self.spec_verifications:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_verifications
