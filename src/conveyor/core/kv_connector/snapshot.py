"""A snapshot of the KV blocks an engine holds, as KV events: for a reader of the event stream
that missed batches (``KVEventLog.dropped``) or starts late.

Per tier, an ``AllBlocksCleared`` and then a ``BlockStored`` run per chain of the blocks it holds
now: applied after a reset, it leaves the reader's index equal to the engine's state at the
snapshot, and the batches published after it keep the index exact (``routing/kv_index.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from conveyor.core.kv_connector.events import POOL, KVEvent, KVEventLog
from conveyor.core.kv_connector.keys import BlockRecord


def snapshot_events(block_size: int, pool: Iterable[tuple[BlockRecord, int]],
                    root: Callable[[int], bytes],
                    tiers: Iterable[tuple[str, Iterable[BlockRecord]]] = ()) -> list[KVEvent]:
    """``pool``: (record, LoRA id) of each keyed block of the pool; ``root(lora_id)``: the root
    key of an adapter's blocks; ``tiers``: (tier name, records) of each offload tier (base-model
    blocks only, as the tiers keep)."""
    log = KVEventLog(block_size)
    log.cleared(POOL)
    for record, lora_id in pool:
        log.stored(POOL, record, record.parent == root(lora_id), lora_id)
    base = root(0)
    for name, records in tiers:
        log.cleared(name)
        for record in records:
            log.stored(name, record, record.parent == base)
    log.flush(0.0)
    return [e for batch in log.drain() for e in batch.events]
