"""A decode instance's inbound queue: handed-off requests wait here until its pool can hold them.

DistServe's decode instances *pull* a request's KV cache when they have room for it, so a burst
of prefills queues up instead of overflowing decode memory. Here a handoff joins the decode
scheduler (which then loads its blocks through its connector, ``sim/remote_prefill.py``) only
when the free blocks, less what the scheduler has already promised, cover the whole request:
its prompt plus first token. Promised: the blocks still to come for sequences loading, every
waiting sequence's blocks, and one block for each running sequence that needs a new one next
step. Handoffs join in arrival order; the first that does not fit stops the rest.

Without the gate, the engine's own rule (``core/kv_loading.py``: a load needs room for the
whole request beside the loads in flight, else the request is admitted as usual) would have a
decode instance short of room recompute a prompt instead of waiting for its transfer.
"""

from __future__ import annotations

from collections import deque


def promised_blocks(scheduler) -> int:
    """Free blocks the scheduler will take for work it already holds."""
    bm = scheduler.block_manager
    loading = sum(bm.num_blocks_for(len(s.token_ids)) - len(s.block_tables[0])
                  for s in scheduler.loading.values())
    waiting = sum(bm.num_blocks_for(len(s.token_ids)) for s in scheduler.waiting)
    return loading + waiting + len(scheduler.seqs_needing_block)


class Inbound:
    """Handoffs for one decode instance: (handoff time, request index, tokens it needs)."""

    def __init__(self) -> None:
        self.queue: deque[tuple[float, int, int]] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, t: float, k: int, num_tokens: int) -> None:
        self.queue.append((t, k, num_tokens))

    def admit(self, scheduler) -> list[tuple[float, int]]:
        """Pop the handoffs that fit now, in order."""
        if not self.queue:
            return []
        bm = scheduler.block_manager
        total = bm.gpu.num_blocks
        room = bm.gpu.num_free - promised_blocks(scheduler)
        out = []
        while self.queue:
            t, k, num_tokens = self.queue[0]
            need = bm.num_blocks_for(num_tokens)
            if need > room and need <= total:  # larger than the pool: the scheduler ignores it
                break
            self.queue.popleft()
            room -= need
            out.append((t, k))
        return out
