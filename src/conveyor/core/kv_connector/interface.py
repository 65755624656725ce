"""The KV connector's two halves and what crosses between them each step.

After vLLM v1's KV connector API. The *scheduler half* (``KVConnectorScheduler``, pure Python,
in the scheduler's thread) decides which blocks of a waiting request can be loaded from outside
the pool, and which of the pool's blocks to save where, and writes those decisions as the ops of
a step's ``KVConnectorMetadata`` (``SchedulerOutput.kv_connector_metadata``). The *runner half*
(beside the model runner, which owns the KV-cache tensors: ``executor/kv_offload_worker.py``)
carries the ops out, in order, and reports what finished in a ``KVConnectorOutput``
(``ExecutorOutput.kv_connector_output``), which the scheduler hands back to its half.

Order and timing, the contract between the halves:

* ``SaveBlock``: the block's contents are read before anything of the step writes into the
  pool (before swaps, copies, loads and the forward): the scheduler has already handed the
  block to new contents. The rest of a save (checksums, writing to its tier) may finish later.
* ``LoadBlocks``: the runner writes the entries' contents into the blocks, which the request
  holds until the load is reported finished (nothing else reads or writes them meanwhile); it
  may finish any number of steps later. ``KVConnectorOutput.finished_loads`` says how many of the
  leading blocks arrived intact; the rest are not loaded.
* ``MoveBlock`` / ``DropBlock`` / ``ClearTier``: storage housekeeping.
* The runner runs the ops of a step after the ops of earlier steps, each in its order: a load of
  a key saved earlier sees it saved, a drop after a load leaves the load intact.

Entries carry a ``serial`` (unique per stored copy): a report of a lost entry names it, so the
scheduler half forgets only that copy, not a later one under the same key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.kv_connector.keys import BlockRecord


@dataclass(frozen=True, slots=True)
class SaveBlock:
    """Store pool block ``block``'s contents as ``record`` in ``tier``."""

    block: int
    record: BlockRecord
    tier: str
    serial: int


@dataclass(frozen=True, slots=True)
class MoveBlock:
    """Move the entry ``key`` from tier ``source`` to tier ``dest``."""

    key: bytes
    source: str
    dest: str
    serial: int


@dataclass(frozen=True, slots=True)
class DropBlock:
    key: bytes
    tier: str


@dataclass(frozen=True, slots=True)
class ClearTier:
    tier: str


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One block to load: ``record``'s contents from ``tier`` into pool block ``block``."""

    block: int
    record: BlockRecord
    tier: str
    serial: int


@dataclass(frozen=True, slots=True)
class LoadBlocks:
    """Load a request's blocks (in prefix order) for sequence ``seq_id``."""

    seq_id: int
    items: tuple[LoadItem, ...]


KVConnectorOp = SaveBlock | MoveBlock | DropBlock | ClearTier | LoadBlocks


@dataclass(slots=True)
class KVConnectorMetadata:
    """One step's ops for the runner half, in the order they were decided."""

    ops: list[KVConnectorOp] = field(default_factory=list)


def take_metadata(pending: list[KVConnectorOp]) -> KVConnectorMetadata | None:
    """A scheduler half's ``build_metadata``: the ops queued since the last step (None if none),
    leaving ``pending`` empty."""
    if not pending:
        return None
    meta = KVConnectorMetadata(list(pending))
    pending.clear()
    return meta


@dataclass(frozen=True, slots=True)
class LostEntry:
    """A stored copy that could not be read back intact (or written): the runner removed it."""

    key: bytes
    tier: str
    serial: int
    reason: str  # "corrupt" (checksum, size or header), "missing", "unreadable", "write failed"


@dataclass(slots=True)
class KVConnectorOutput:
    finished_loads: dict[int, int] = field(default_factory=dict)  # seq_id -> intact leading blocks
    lost: list[LostEntry] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finished_loads or self.lost)


class KVConnectorScheduler(Protocol):
    """The scheduler half. The scheduler calls it from its own thread only."""

    def lookup(self, records: Iterable[BlockRecord]) -> list[BlockRecord]:
        """The leading ``records`` (a request's next blocks, in prefix order) the connector can
        load: each matches a stored entry's key, tokens and parent key exactly. Found entries
        count as used."""
        ...

    def start_load(self, seq_id: int, blocks: list[int], records: list[BlockRecord]) -> None:
        """Load ``records`` (found by ``lookup`` this step) into pool ``blocks``; the load may
        stop short (its report says how many blocks arrived)."""
        ...

    def block_evicted(self, block: int, record: BlockRecord) -> None:
        """The pool is handing ``block`` (holding ``record``) to new contents: save it if
        wanted."""
        ...

    def clear(self) -> None:
        """Forget every stored block."""
        ...

    def build_metadata(self) -> KVConnectorMetadata | None:
        """This step's ops (None: none), in order; the next step's start empty."""
        ...

    def update(self, output: KVConnectorOutput) -> None:
        """The runner half's report: finished loads, lost entries."""
        ...
