"""InboundKVScheduler: the scheduler half of a decode engine's KV connector — prompt blocks
another engine computed (prefill/decode disaggregation, docs/kv_cache.md).

Before a handed-off request joins the scheduler, the engine *offers* its prompt's full blocks
here (``offer``: their records, under the request's id; the bytes wait in the runner half's
store). The scheduler admits the request through the connector path every engine has
(``core/kv_loading.py``): ``lookup`` finds the offered blocks past its pool hits, ``start_load``
turns them into one ``LoadBlocks`` op of tier ``"remote"``, and the runner half writes the
verified bytes into the request's fresh blocks; the request then computes only its tail. An
offer lasts until ``withdraw`` (the request ended): a request preempted after its load loads
again rather than recompute, while the offer stands.

Offers are counted per key: two requests with the same prefix share the stored copy, which goes
when the last offer holding it is withdrawn (``withdraw`` returns those keys).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.core.kv_connector.interface import (
    KVConnectorMetadata,
    KVConnectorOp,
    KVConnectorOutput,
    LoadBlocks,
    LoadItem,
    take_metadata,
)
from conveyor.core.kv_connector.keys import BlockRecord

REMOTE = "remote"  # the tier name of blocks handed over by another engine


@dataclass(frozen=True, slots=True)
class InboundStats:
    offered_blocks: int = 0  # blocks offered with handed-off requests (total)
    loaded_blocks: int = 0  # blocks loaded intact instead of computed (total)
    lost_blocks: int = 0  # blocks that failed verification or were gone (total)
    held_blocks: int = 0  # distinct blocks offered now


class InboundKVScheduler:
    """Implements ``KVConnectorScheduler``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._records: dict[bytes, BlockRecord] = {}  # key -> the offered record
        self._holders: Counter[bytes] = Counter()  # key -> offers holding it
        self._offers: dict[str, list[bytes]] = {}  # request id -> its offered keys
        self._bad: set[bytes] = set()  # keys whose stored copy failed: computed by every holder
        self._ops: list[KVConnectorOp] = []
        self._offered = self._loaded = self._lost = 0

    # -- the engine's side -----------------------------------------------------------------

    def offer(self, request_id: str, records: list[BlockRecord]) -> None:
        """``records`` (a prompt's leading full blocks, in order) can be loaded for the request
        ``request_id`` until it is withdrawn. ValueError if it has an offer already."""
        if request_id in self._offers:
            raise ValueError(f"request {request_id!r} has KV blocks offered already")
        keys = []
        for record in records:
            held = self._records.get(record.key)
            if held is not None and held != record:
                break  # another content under this key (a digest collision): offer no further
            self._records[record.key] = record
            self._holders[record.key] += 1
            keys.append(record.key)
        self._offers[request_id] = keys
        self._offered += len(keys)

    def withdraw(self, request_id: str) -> list[bytes]:
        """Forget ``request_id``'s offer; the keys no offer holds any more."""
        gone = []
        for key in self._offers.pop(request_id, []):
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
                del self._records[key]
                self._bad.discard(key)
                gone.append(key)
        return gone

    # -- KVConnectorScheduler --------------------------------------------------------------

    def lookup(self, records: Iterable[BlockRecord]) -> list[BlockRecord]:
        found = []
        for record in records:
            if self._records.get(record.key) != record or record.key in self._bad:
                break
            found.append(record)
        return found

    def start_load(self, seq_id: int, blocks: list[int], records: list[BlockRecord]) -> None:
        items = tuple(LoadItem(block, record, REMOTE, 0)
                      for block, record in zip(blocks, records, strict=True))
        self._ops.append(LoadBlocks(seq_id, items))

    def block_evicted(self, block: int, record: BlockRecord) -> None:
        pass  # no tier of its own: an evicted block is computed again if needed

    def clear(self) -> None:
        pass  # offers belong to running requests, not to the prefix cache

    def build_metadata(self) -> KVConnectorMetadata | None:
        return take_metadata(self._ops)

    def update(self, output: KVConnectorOutput) -> None:
        self._loaded += sum(output.finished_loads.values())
        for lost in output.lost:
            self._lost += 1
            if lost.key in self._records:
                self._bad.add(lost.key)

    @property
    def stats(self) -> InboundStats:
        return InboundStats(self._offered, self._loaded, self._lost, len(self._records))
