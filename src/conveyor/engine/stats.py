"""EngineStats: one snapshot of the engine's gauges and counters (what /metrics and benches read)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    # scheduler gauges and counters (SchedulerStats)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    spec_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verifications: int = 0  # decodes that verified a proposal
    # engine counters
    num_steps: int = 0
    scheduled_seqs_total: int = 0  # sum over steps of the batch size (sequences in the step)
    scheduled_tokens_total: int = 0  # sum over steps of the tokens computed in the step
    prompt_tokens_total: int = 0  # prompt (and recomputed) tokens run through the model
    generation_tokens_total: int = 0  # tokens sampled
    finished_by_reason: dict[str, int] = field(default_factory=dict)  # per finished sequence
    # LoRA adapter pool (docs/lora.md); zero without --enable-lora
    lora_adapters_in_memory: int = 0  # adapters whose weights are read into host memory
    lora_slot_installs: int = 0  # adapters copied into a model slot
    lora_adapter_reads: int = 0  # adapters read again from their files (host memory was full)
    max_loras: int = 0  # adapters that may run at once
    lora_running_adapters: list[str] = field(default_factory=list)  # names, sorted
    lora_waiting_adapters: list[str] = field(default_factory=list)  # with none running, sorted

    SCHEDULER_FIELDS = ("num_running", "num_waiting", "num_swapped", "num_free_blocks",
                        "num_total_blocks", "kv_usage", "num_preemptions",
                        "prefix_cache_queries", "prefix_cache_hits", "spec_draft_tokens",
                        "spec_accepted_tokens", "spec_verifications")

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
