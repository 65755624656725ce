"""TieredOffloadScheduler: the scheduler half of the offloading connector — a prefix cache
beyond the pool, in a host-memory tier and then a local-disk tier.

Blocks the pool evicts (``block_evicted``) are saved to the first tier unless a tier holds them
already (then they only become its most recently used). A full tier makes room by moving its
least recently used entry down to the next tier (host memory -> disk), which in turn drops its
own least recently used; the last tier drops. A block is in at most one tier. A waiting
request's blocks past its pool hits are looked up tier by tier (``lookup``: key, tokens and
parent key must all match) and loaded into fresh pool blocks (``start_load``); loaded entries
stay where they are, most recently used.

Each decision is an op of the step's ``KVConnectorMetadata`` (``interface.py``) for the runner
half, and, with a ``KVEventLog``, a KV event of its tier. What the runner finds corrupt,
truncated or missing when it reads an entry back, or fails to write, it removes and reports
(``update``): the entry leaves the index and that block is computed again, never used.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.core.kv_connector.events import CPU, DISK, KVEventLog
from conveyor.core.kv_connector.interface import (
    ClearTier,
    DropBlock,
    KVConnectorMetadata,
    KVConnectorOp,
    KVConnectorOutput,
    LoadBlocks,
    LoadItem,
    MoveBlock,
    SaveBlock,
    take_metadata,
)
from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.core.kv_connector.tier_index import TierEntry, TierIndex


@dataclass(frozen=True, slots=True)
class KVOffloadStats:
    hits_cpu: int = 0  # prompt tokens loaded from the host-memory tier instead of computed
    hits_disk: int = 0  # prompt tokens loaded from the disk tier instead of computed
    blocks_cpu: int = 0  # blocks the host-memory tier holds now
    blocks_disk: int = 0  # blocks the disk tier holds now
    capacity_cpu: int = 0  # most blocks it may hold
    capacity_disk: int = 0
    saved_blocks: int = 0  # blocks saved from the pool (total)
    moved_blocks: int = 0  # blocks moved from host memory to disk (total)
    loaded_blocks: int = 0  # blocks loaded back intact (total)
    lost_blocks: int = 0  # entries found corrupt, truncated or missing, or not written (total)


class TieredOffloadScheduler:
    """Implements ``KVConnectorScheduler``."""

    def __init__(self, cpu_blocks: int, disk_blocks: int, block_size: int, root: bytes,
                 events: KVEventLog | None = None) -> None:
        """Tiers of ``cpu_blocks`` and ``disk_blocks`` blocks (0: no such tier); ``root``: the
        root key of the blocks it stores (a first block's parent, reported as None in events)."""
        self.tiers = [TierIndex(name, n) for name, n in ((CPU, cpu_blocks), (DISK, disk_blocks))
                      if n > 0]
        if not self.tiers:
            raise ValueError("a tiered offload connector needs a tier of at least one block")
        self.block_size = block_size
        self._root = root
        self._events = events
        self._ops: list[KVConnectorOp] = []
        self._serials = itertools.count(1)
        self._loading: dict[int, list[str]] = {}  # seq_id -> the tier of each block it loads
        self._hits = {CPU: 0, DISK: 0}
        self._saved = self._moved = self._loaded = self._lost = 0

    def adopt(self, tier_name: str, records: Iterable[BlockRecord]) -> None:
        """Entries the runner half found stored at start-up (a persistent disk tier), least
        recently used first; past the tier's capacity the oldest are dropped."""
        tier = self._tier(tier_name)
        for record in records:
            if self._find(record) is not None or any(t.get(record.key) for t in self.tiers):
                continue
            if tier.full:
                self._ops.append(DropBlock(tier.pop_lru().record.key, tier.name))
            tier.add(TierEntry(record, next(self._serials)))
        if self._events is not None:
            for entry in tier:
                self._announce(tier.name, entry.record)

    # -- lookups and loads -----------------------------------------------------------------

    def lookup(self, records: Iterable[BlockRecord]) -> list[BlockRecord]:
        if not any(len(t) for t in self.tiers):
            return []
        found = []
        for record in records:
            hit = self._find(record)
            if hit is None:
                break
            hit[0].touch(record.key)  # most recently used: the pool's evictions that make room
            found.append(record)  # for its load move other entries first
        return found

    def start_load(self, seq_id: int, blocks: list[int], records: list[BlockRecord]) -> None:
        items = []
        for block, record in zip(blocks, records, strict=True):
            hit = self._find(record)
            if hit is None:  # dropped to make room for this very load's evictions: stop here
                break
            tier, entry = hit
            tier.touch(record.key)
            items.append(LoadItem(block, record, tier.name, entry.serial))
        self._ops.append(LoadBlocks(seq_id, tuple(items)))
        self._loading[seq_id] = [item.tier for item in items]

    # -- saves -----------------------------------------------------------------------------

    def block_evicted(self, block: int, record: BlockRecord) -> None:
        found = self._find(record)
        if found is not None:
            found[0].touch(record.key)
            return
        if any(t.get(record.key) for t in self.tiers):
            return  # another content under this key (a digest collision): keep the stored one
        first = self.tiers[0]
        self._make_room(0)
        serial = next(self._serials)
        first.add(TierEntry(record, serial))
        self._ops.append(SaveBlock(block, record, first.name, serial))
        self._saved += 1
        self._announce(first.name, record)

    def _make_room(self, i: int) -> None:
        tier = self.tiers[i]
        while tier.full:
            victim = tier.pop_lru()
            key = victim.record.key
            if self._events is not None:
                self._events.removed(tier.name, key)
            if i + 1 == len(self.tiers):
                self._ops.append(DropBlock(key, tier.name))
                continue
            self._make_room(i + 1)
            lower = self.tiers[i + 1]
            lower.add(victim)
            self._ops.append(MoveBlock(key, tier.name, lower.name, victim.serial))
            self._moved += 1
            self._announce(lower.name, victim.record)

    def held(self) -> list[tuple[str, list[BlockRecord]]]:
        """(tier name, records of the blocks it holds, least recently used first) per tier."""
        return [(tier.name, [entry.record for entry in tier]) for tier in self.tiers]

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()
            self._ops.append(ClearTier(tier.name))
            if self._events is not None:
                self._events.cleared(tier.name)

    # -- the runner half's side ------------------------------------------------------------

    def build_metadata(self) -> KVConnectorMetadata | None:
        return take_metadata(self._ops)

    def update(self, output: KVConnectorOutput) -> None:
        for seq_id, num_intact in output.finished_loads.items():
            tiers = self._loading.pop(seq_id, [])
            for name in tiers[:num_intact]:
                self._hits[name] += self.block_size
            self._loaded += num_intact
        for lost in output.lost:
            self._lost += 1
            for tier in self.tiers:
                entry = tier.get(lost.key)
                if entry is not None and entry.serial == lost.serial:
                    tier.remove(lost.key)
                    if self._events is not None:
                        self._events.removed(tier.name, lost.key)

    @property
    def stats(self) -> KVOffloadStats:
        sizes = {t.name: (len(t), t.capacity) for t in self.tiers}
        cpu, cpu_cap = sizes.get(CPU, (0, 0))
        disk, disk_cap = sizes.get(DISK, (0, 0))
        return KVOffloadStats(self._hits[CPU], self._hits[DISK], cpu, disk, cpu_cap, disk_cap,
                              self._saved, self._moved, self._loaded, self._lost)

    # -- helpers ---------------------------------------------------------------------------

    def _tier(self, name: str) -> TierIndex:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ValueError(f"no {name!r} tier")

    def _find(self, record: BlockRecord) -> tuple[TierIndex, TierEntry] | None:
        for tier in self.tiers:
            entry = tier.match(record)
            if entry is not None:
                return tier, entry
        return None

    def _announce(self, tier: str, record: BlockRecord) -> None:
        if self._events is not None:
            self._events.stored(tier, record, record.parent == self._root)
