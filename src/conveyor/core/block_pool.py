"""BlockPool: the physical GPU KV blocks — ref counts, free list, prefix-cache table, LRU eviction.

Ownership (after vLLM v1's block_pool / kv_cache_manager split): this module knows blocks, not
sequences. A block is *free* when its ref count is 0. Free blocks come in two kinds:

* uncached: a plain stack, handed out first;
* cached: registered in the prefix-cache table, kept reusable until evicted, least recently
  freed first (an OrderedDict used as an LRU list).

A registered block stores the hash it is filed under, its token ids and its parent's
*identity* ``(block id, generation)``. A block's generation changes every time it is handed out
for new content, so an identity names one content, forever. A lookup hit must match the tokens
and the parent identity exactly: by induction the whole prefix matches, whatever the hash did.
A full block whose content duplicates an already-registered block is not filed twice; it
records the registered twin's identity as its *alias*, so its children chain correctly.

The stored parent is a *key* (``ParentKey``): a parent's identity for the blocks that form a
chain (KV-cache group 0), or, for the blocks of the other KV-cache groups, the identity of the
group-0 block of the same index plus the group number (``BlockManager.register_full_blocks``):
that identity names the exact prefix up to the block's end, so the same check verifies them.

With a KV connector or KV events (``core/kv_connector``), a group-0 block is also filed with its
content key (``KeyInfo``: key, parent key, LoRA id), and the pool tells its ``observer`` what it
stores, removes and evicts: an evicted block's contents are still intact when ``evicted`` is
called (the caller that gets the block writes it only in the step being built).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from conveyor.core.kv_connector.keys import BlockRecord

if TYPE_CHECKING:
    from conveyor.core.kv_connector.pool_observer import PoolObserver

Identity = tuple[int, int]  # (block id, generation)
ROOT_IDENTITY: Identity = (-1, 0)  # the parent of every first block (on the base model)
ParentKey = tuple[int, ...]  # an Identity, or (block id, generation, group) (module docstring)
KeyInfo = tuple[bytes, bytes, int]  # content key, parent's content key, LoRA id


def root_identity(lora_id: int) -> Identity:
    """The parent of a first block computed under LoRA adapter ``lora_id`` (0: none)."""
    return (-1, lora_id)


class BlockPool:
    __slots__ = ("num_blocks", "ref_counts", "_free", "_evictable", "_block_by_hash", "_hash",
                 "_tokens", "_parent", "_generation", "_alias", "_key", "observer")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_by_hash: dict[int, int] = {}  # hash -> registered block
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[list[int] | None] = [None] * num_blocks
        self._parent: list[ParentKey | None] = [None] * num_blocks
        self._generation = [0] * num_blocks
        self._alias: list[Identity | None] = [None] * num_blocks
        self._key: list[KeyInfo | None] = [None] * num_blocks
        self.observer: PoolObserver | None = None

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self._block_by_hash)

    # ------------------------------------------------------------------ allocate / free

    def allocate(self) -> int:
        """A block for new content (ref count 1). Caller checks ``num_free`` first."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently freed
            info = self._key[block]
            if info is not None and self.observer is not None:
                self.observer.evicted(block, self._record(block, info), info[2])
            self._forget(block)
        self._generation[block] += 1
        self._alias[block] = None
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more owner (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def free(self, block: int, keep_cached: bool = True) -> None:
        """One owner fewer; at zero the block is free (still reusable if registered)."""
        refs = self.ref_counts[block] - 1
        self.ref_counts[block] = refs
        if refs:
            return
        if self._hash[block] is not None:
            if keep_cached:
                self._evictable[block] = None
                return
            self._forget(block)
        self._free.append(block)

    # ------------------------------------------------------------------ prefix cache

    def identity(self, block: int) -> Identity | None:
        """The content identity children chain to: own if registered, else a registered twin's."""
        if self._hash[block] is not None:
            return (block, self._generation[block])
        return self._alias[block]

    def lookup(self, block_hash: int, parent: ParentKey, token_ids: list[int]) -> int | None:
        block = self._block_by_hash.get(block_hash)
        if block is None or self._parent[block] != parent or self._tokens[block] != token_ids:
            return None
        return block

    def register(self, block: int, block_hash: int, parent: ParentKey,
                 token_ids: list[int], key: KeyInfo | None = None) -> None:
        """File a full, computed (or being computed this step) block under ``block_hash``
        (``key``: its content key, when keyed)."""
        other = self._block_by_hash.get(block_hash)
        if other is not None:
            if other == block:
                return
            if self._parent[other] == parent and self._tokens[other] == token_ids:
                self._alias[block] = (other, self._generation[other])
                return
            self._unregister(other)  # a collision or a stale chain: the newer content wins
        self._block_by_hash[block_hash] = block
        self._hash[block] = block_hash
        self._tokens[block] = token_ids
        self._parent[block] = parent
        if key is not None:
            self._key[block] = key
            if self.observer is not None:
                self.observer.stored(self._record(block, key), key[2])

    def keyed_records(self) -> list[tuple[BlockRecord, int]]:
        """(record, LoRA id) of every block registered with a content key, in block order."""
        return [(self._record(b, info), info[2]) for b, info in enumerate(self._key)
                if info is not None]

    def _record(self, block: int, info: KeyInfo) -> BlockRecord:
        return BlockRecord(info[0], info[1], tuple(self._tokens[block]))  # type: ignore[arg-type]

    def clear_cached(self) -> bool:
        """Forget every cached block, when no block is in use (False, nothing done, else)."""
        if any(self.ref_counts):
            return False
        for block in list(self._evictable):
            self._hash[block] = self._tokens[block] = self._parent[block] = None
            self._key[block] = None
            self._generation[block] += 1
        self._block_by_hash.clear()
        self._evictable.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        if self.observer is not None:
            self.observer.cleared()
        return True

    def _unregister(self, block: int) -> None:
        self._forget(block)
        self._generation[block] += 1  # its identity is gone: children chained to it go stale
        if self.ref_counts[block] == 0:
            del self._evictable[block]
            self._free.append(block)

    def _forget(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            if self._block_by_hash.get(h) == block:
                del self._block_by_hash[h]
            self._hash[block] = None
            self._tokens[block] = None
            self._parent[block] = None
            info = self._key[block]
            if info is not None:
                self._key[block] = None
                if self.observer is not None:
                    self.observer.removed(info[0])

    # ------------------------------------------------------------------ checks (tests)

    def check_consistency(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise AssertionError("a block is listed twice among free blocks")
        for b in range(self.num_blocks):
            in_free = b in free or b in evictable
            if (self.ref_counts[b] == 0) != in_free:
                raise AssertionError(f"block {b}: ref count {self.ref_counts[b]}, free={in_free}")
            if b in evictable and self._hash[b] is None:
                raise AssertionError(f"block {b} is evictable but not registered")
        for h, b in self._block_by_hash.items():
            if self._hash[b] != h:
                raise AssertionError(f"prefix table entry {h} -> {b} disagrees with the block")


class CpuBlockPool:
    """The CPU swap pool: a free list, no sharing, no caching."""

    __slots__ = ("num_blocks", "_free")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, block: int) -> None:
        self._free.append(block)
