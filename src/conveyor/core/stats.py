"""SchedulerStats: a read-only snapshot of the scheduler's queues, KV usage and counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int  # sequences holding KV blocks and being computed (decoding or mid-prefill)
    num_waiting: int  # sequences waiting to be (re)prefilled
    num_swapped: int  # sequences whose KV blocks sit in the CPU pool
    num_free_blocks: int  # GPU blocks free or holding evictable cached prefixes
    num_total_blocks: int
    kv_usage: float  # fraction of GPU blocks in use, in [0, 1]
    num_preemptions: int  # total since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens whose computation was really skipped
    spec_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verifications: int = 0  # decodes that verified a proposal
