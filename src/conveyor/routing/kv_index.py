"""KVIndex: which replica holds which KV block, in which tier, built from the replicas' KV events.

Exact, not a guess: every ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` a replica
publishes (``core/kv_connector/events.py``) is applied to that replica's entries, so the index
holds what the replica's pool and offload tiers held when it published its last batch. Blocks are
named by their content keys (``core/kv_connector/keys.py``), the same for the same prefix in
every replica of one model, so one lookup walks a prompt's keys over all replicas at once.

A reader that missed batches (the event log's ``dropped``, a lost reply) cannot patch its view:
it ``reset``s the replica and applies a snapshot (every block the replica holds, as
``BlockStored`` events after an ``AllBlocksCleared`` per tier) before the batches that follow.
Applying is idempotent per key (a store of a held key or a removal of an absent one changes
nothing), so a snapshot that overlaps batches applied after it converges to the replica's state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from conveyor.core.kv_connector.events import (
    CPU,
    DISK,
    POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

TIERS = (POOL, CPU, DISK)  # fastest first: a block held in several tiers counts as the first


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest prefix of a prompt's blocks one replica holds, block by block in any tier."""

    blocks: int = 0  # leading prompt blocks held
    per_tier: tuple[int, ...] = (0, 0, 0)  # of those, how many each tier (TIERS order) serves


class KVIndex:
    def __init__(self) -> None:
        # key -> {replica: bitmask of the tiers (bit i: TIERS[i]) that hold it}
        self._holders: dict[bytes, dict[Hashable, int]] = {}
        # replica -> tier -> keys: what AllBlocksCleared and reset take away
        self._keys: dict[Hashable, dict[str, set[bytes]]] = {}

    # -- updates ----------------------------------------------------------------------------

    def apply(self, replica: Hashable, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events, in the order it published them."""
        for event in events:
            if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
                raise ValueError(f"not a KV event: {event!r}")
            tier = _tier_bit(event.tier)
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    self._add(replica, key, event.tier, tier)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    self._drop(replica, key, event.tier, tier)
            else:
                for key in list(self._tier_keys(replica, event.tier)):
                    self._drop(replica, key, event.tier, tier)

    def reset(self, replica: Hashable) -> None:
        """Forget everything ``replica`` holds (before a snapshot, or when it left)."""
        tiers = self._keys.pop(replica, {})
        for keys in tiers.values():
            for key in keys:
                holders = self._holders.get(key)
                if holders is not None:
                    holders.pop(replica, None)
                    if not holders:
                        del self._holders[key]

    remove = reset

    def _tier_keys(self, replica: Hashable, tier: str) -> set[bytes]:
        return self._keys.setdefault(replica, {}).setdefault(tier, set())

    def _add(self, replica: Hashable, key: bytes, tier: str, bit: int) -> None:
        holders = self._holders.setdefault(key, {})
        holders[replica] = holders.get(replica, 0) | bit
        self._tier_keys(replica, tier).add(key)

    def _drop(self, replica: Hashable, key: bytes, tier: str, bit: int) -> None:
        self._tier_keys(replica, tier).discard(key)
        holders = self._holders.get(key)
        if holders is None or replica not in holders:
            return
        mask = holders[replica] & ~bit
        if mask:
            holders[replica] = mask
        else:
            del holders[replica]
            if not holders:
                del self._holders[key]

    # -- queries ----------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes],
              replicas: Iterable[Hashable]) -> dict[Hashable, PrefixMatch]:
        """For each replica, the longest run of ``keys`` (a prompt's block keys, in order) it
        holds from the first block on; a key missing from every tier of a replica ends its run
        (a block's KV is usable only after its whole prefix)."""
        counts = {r: [0, 0, 0] for r in replicas}
        live = list(counts)
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                break
            still = []
            for r in live:
                mask = holders.get(r, 0)
                if mask:
                    counts[r][_first_tier(mask)] += 1
                    still.append(r)
            live = still
            if not live:
                break
        return {r: PrefixMatch(sum(c), tuple(c)) for r, c in counts.items()}

    def num_blocks(self, replica: Hashable, tier: str = POOL) -> int:
        return len(self._keys.get(replica, {}).get(tier, ()))

    def holders(self, key: bytes) -> dict[Hashable, tuple[str, ...]]:
        """Replica -> the tiers that hold ``key`` (tests, debugging)."""
        return {r: tuple(t for i, t in enumerate(TIERS) if mask >> i & 1)
                for r, mask in self._holders.get(key, {}).items()}


def _tier_bit(tier: str) -> int:
    try:
        return 1 << TIERS.index(tier)
    except ValueError:
        raise ValueError(f"unknown KV tier {tier!r}; expected one of {TIERS}") from None


def _first_tier(mask: int) -> int:
    return (mask & -mask).bit_length() - 1
