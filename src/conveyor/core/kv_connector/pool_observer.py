"""PoolObserver: what the pool's prefix cache does to keyed blocks, passed on — stored and
removed blocks as KV events of the ``"pool"`` tier, evicted ones to the KV connector (which
decides whether to save them)."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.kv_connector.events import POOL, KVEventLog
from conveyor.core.kv_connector.interface import KVConnectorScheduler
from conveyor.core.kv_connector.keys import BlockRecord


class PoolObserver:
    def __init__(self, events: KVEventLog | None, connector: KVConnectorScheduler | None,
                 root: Callable[[int], bytes]) -> None:
        """``root(lora_id)``: the root key of the blocks computed under that adapter."""
        self._events = events
        self._connector = connector
        self._root = root

    def stored(self, record: BlockRecord, lora_id: int) -> None:
        if self._events is not None:
            self._events.stored(POOL, record, record.parent == self._root(lora_id), lora_id)

    def removed(self, key: bytes) -> None:
        if self._events is not None:
            self._events.removed(POOL, key)

    def evicted(self, block: int, record: BlockRecord, lora_id: int) -> None:
        """Only base-model blocks leave the pool for the connector: an adapter's id is this
        engine's own, not a name another engine (or a later run) shares."""
        if self._connector is not None and lora_id == 0:
            self._connector.block_evicted(block, record)

    def cleared(self) -> None:
        if self._events is not None:
            self._events.cleared(POOL)
