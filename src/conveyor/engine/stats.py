"""EngineStats: one snapshot of the engine's gauges and counters (what /metrics and benches read):
the scheduler's snapshot, and the engine's own totals beside it."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.kv_connector.inbound import InboundStats
from conveyor.core.kv_connector.offload import KVOffloadStats
from conveyor.core.stats import SchedulerStats


@dataclass
class EngineStats:
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)  # queues, KV, counters
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
    # KV offload tiers (docs/kv_cache.md): hits per tier and what they hold; None without them.
    # ``scheduler.prefix_cache_hits`` counts every prompt token not computed, loaded ones too.
    kv_offload: KVOffloadStats | None = None
    # KV blocks handed over by prefill engines (a --pd decode replica); None: not one
    kv_transfer: InboundStats | None = None
