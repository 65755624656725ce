"""StepInput: one step as every rank's ``ModelRunner.forward`` runs it, in plain integers: the
tokens to compute (ids, each entry's start position and count, its block table in every
KV-cache group), which flat tokens' logits are wanted, the scheduler's block operations (swap
out, swap in, copy) and each entry's LoRA slot. Rank 0's runner lays a ``SchedulerOutput`` out
as one (``ModelRunner.prepare``); under tensor parallelism ``distributed/step.py`` ships it to
the other ranks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInput:
    input_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per entry: first position computed
    counts: list[int] = field(default_factory=list)  # per entry: tokens computed
    block_tables: list[list[int]] = field(default_factory=list)  # per entry: KV-cache group 0's
    # groups 1..G-1 (hybrid KV cache), per group per entry; NULL_BLOCK (-1) before a window
    group_tables: list[list[list[int]]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # per entry: its adapter's slot (0: none)
