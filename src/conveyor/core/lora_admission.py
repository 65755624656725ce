"""Which waiting requests may start in a step, by their LoRA adapter.

At most ``max_loras`` distinct adapters run at once (the model's adapter slots), and a request
starts only once its adapter's weights are loaded (``Scheduler.loaded_loras``). Requests that
may not start yet are skipped, not waited on: base-model requests and those of running
adapters go ahead of them. So that a waiting adapter is not starved by running ones that keep
receiving requests, the first adapter in queue order that finds no free slot names one running
adapter to drain: the one with the fewest running sequences (then the lowest id). That adapter
starts no new request until the waiting one has its slot.
"""

from __future__ import annotations

from collections import Counter

from conveyor.core.sequence import Sequence


class LoRAAdmission:
    def __init__(self, max_loras: int, running: Counter[int], loaded: set[int] | None) -> None:
        """``running``: sequences per adapter that hold a slot (running, prefilling or swapped
        out); ``loaded``: the adapters whose weights are loaded (None: all)."""
        self.max_loras = max_loras
        self.running = running
        self.loaded = loaded
        self.draining: int | None = None
        self.skipped_unloaded = False  # a request waits for its adapter's weights

    def allows(self, seq: Sequence) -> bool:
        lora = seq.group.lora_id
        if lora == 0:
            return True
        if self.loaded is not None and lora not in self.loaded:
            self.skipped_unloaded = True
            return False
        if lora in self.running:
            return lora != self.draining
        if len(self.running) < self.max_loras:
            return True
        if self.draining is None:
            self.draining = min(self.running, key=lambda i: (self.running[i], i))
        return False

    def admitted(self, seq: Sequence) -> None:
        lora = seq.group.lora_id
        if lora:
            self.running[lora] += 1
