"""KV events: which blocks an engine stores and removes, per tier, for whoever indexes them.

As vLLM's KV-events stream: ``BlockStored`` (a run of consecutive blocks of one prefix: their
keys in order, the parent key of the first, their token ids), ``BlockRemoved`` (keys) and
``AllBlocksCleared``, each naming its tier: ``"pool"`` (the engine's KV-cache pool), ``"cpu"``
and ``"disk"`` (the offload tiers). Block hashes are content keys (``keys.py``): the same prefix
has the same keys in every engine that runs the same model, so a router can index the events of
many engines and look a prompt's blocks up itself.

``KVEventLog`` collects the events of one engine step (the scheduler's thread records them) and
publishes them as one ``KVEventBatch`` when the engine calls ``flush``: to every subscriber (a
callback, in the engine's thread) and to a bounded queue that ``drain`` or iteration empties (from
any thread). When the queue is full the oldest batches go and ``dropped`` counts them; a reader
that missed batches rebuilds its index from the next ``AllBlocksCleared`` or starts afresh.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conveyor.core.kv_connector.keys import BlockRecord

POOL, CPU, DISK = "pool", "cpu", "disk"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # None: the first block of a prompt
    token_ids: list[int]  # every block's, in order
    block_size: int
    lora_id: int
    tier: str


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    tier: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    tier: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float  # wall-clock time of the step that published it
    events: list[KVEvent]


class KVEventLog:
    def __init__(self, block_size: int, max_pending: int = 4096) -> None:
        self.block_size = block_size
        self._step: list[KVEvent] = []
        self._last: dict[str, KVEvent] = {}  # the step's latest event of each tier
        self._queue: deque[KVEventBatch] = deque()
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[KVEventBatch], None]] = []
        self.dropped = 0  # batches the queue let go unread

    # -- recording (the engine's thread) ---------------------------------------------------

    def stored(self, tier: str, record: BlockRecord, first: bool, lora_id: int = 0) -> None:
        """``record`` is stored in ``tier`` (``first``: a prompt's first block, whose parent is
        reported as None). A block continuing the run of the tier's latest event joins it (each
        tier's events keep their order; events of different tiers may interleave less)."""
        last = self._last.get(tier)
        if (isinstance(last, BlockStored) and last.lora_id == lora_id
                and last.block_hashes[-1] == record.parent):
            last.block_hashes.append(record.key)
            last.token_ids.extend(record.token_ids)
            return
        self._add(BlockStored([record.key], None if first else record.parent,
                              list(record.token_ids), self.block_size, lora_id, tier))

    def removed(self, tier: str, key: bytes) -> None:
        last = self._last.get(tier)
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(key)
        else:
            self._add(BlockRemoved([key], tier))

    def cleared(self, tier: str) -> None:
        self._step = [e for e in self._step if e.tier != tier]
        self._add(AllBlocksCleared(tier))

    def _add(self, event: KVEvent) -> None:
        self._step.append(event)
        self._last[event.tier] = event

    def flush(self, ts: float) -> None:
        """Publish the events recorded since the last flush as one batch (nothing if none)."""
        if not self._step:
            return
        batch = KVEventBatch(ts, self._step)
        self._step = []
        self._last.clear()
        for fn in list(self._subscribers):
            fn(batch)
        with self._lock:
            self._queue.append(batch)
            while len(self._queue) > self._max_pending:
                self._queue.popleft()
                self.dropped += 1

    # -- reading ---------------------------------------------------------------------------

    def subscribe(self, fn: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call ``fn`` with every batch from now on (in the engine's thread: keep it short);
        returns the function that unsubscribes it."""
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def drain(self) -> list[KVEventBatch]:
        """The queued batches, oldest first, and empty the queue."""
        with self._lock:
            batches = list(self._queue)
            self._queue.clear()
        return batches

    def __iter__(self) -> Iterator[KVEventBatch]:
        """The queued batches, taken one at a time until the queue is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                batch = self._queue.popleft()
            yield batch
