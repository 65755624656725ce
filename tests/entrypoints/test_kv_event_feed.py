"""The replica's KVEventFeed and the ingress's KVEventPuller without Ray: the first read is a
snapshot, then deltas; a lost reply or a log that dropped batches brings a snapshot again, and
the router's index stays equal to what the replica holds; a failing replica leaves the rest fed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from conveyor.core.kv_connector.events import (
    POOL,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    KVEventLog,
)
from conveyor.core.kv_connector.keys import BlockRecord, extend_block_keys, root_key
from conveyor.entrypoints.ray_serve.kv_events import KVEventFeed, KVEventPuller
from conveyor.routing import make_router

BS = 4
NS = b"s" * 16


class FakeEngine:
    """An LLMEngine's KV-event side: a log, and a pool of blocks it 'holds'."""

    def __init__(self, max_pending: int = 64) -> None:
        self.kv_events = KVEventLog(BS, max_pending)
        self.kv_key_namespace = NS
        self.held: dict[bytes, BlockRecord] = {}
        self.snapshots = 0

    def store(self, tokens: list[int]) -> list[bytes]:
        root = root_key(NS, 0)
        keys = extend_block_keys([], tokens, BS, len(tokens) // BS, root)
        for j, key in enumerate(keys):
            rec = BlockRecord(key, keys[j - 1] if j else root, tuple(tokens[j * BS:(j + 1) * BS]))
            self.kv_events.stored(POOL, rec, j == 0)
            self.held[key] = rec
        self.kv_events.flush(0.0)
        return keys

    def kv_events_snapshot(self) -> KVEventBatch:
        self.snapshots += 1
        self.kv_events.drain()
        return KVEventBatch(0.0, [AllBlocksCleared(POOL), BlockStored(
            list(self.held), None, [], BS, 0, POOL)])


class InlineAsyncEngine:
    async def run_in_engine_thread(self, fn, *args):
        return fn(*args)


class FakeFleet:
    def __init__(self, feeds: dict[str, KVEventFeed]) -> None:
        self.feeds = feeds
        self.lose_next: set[str] = set()  # replicas whose next reply is lost on the way
        self.down: set[str] = set()

    def live_replicas(self) -> list[str]:
        return sorted(self.feeds)

    async def call_replica(self, method: str, replica: str, *args):
        assert method == "kv_events"
        if replica in self.down:
            raise ConnectionError("replica unreachable")
        reply = await self.feeds[replica].read(*args, InlineAsyncEngine())
        if replica in self.lose_next:
            self.lose_next.discard(replica)
            raise TimeoutError("reply lost")
        return reply


def prompt(conv: int, blocks: int = 3) -> list[int]:
    return [100 * conv + i for i in range(blocks * BS)]


def test_the_puller_keeps_the_index_equal_to_what_replicas_hold() -> None:
    engines = {"a": FakeEngine(), "b": FakeEngine(max_pending=1)}
    fleet = FakeFleet({r: KVEventFeed(e) for r, e in engines.items()})
    router = make_router("kv_aware", block_size=BS)
    puller = KVEventPuller(fleet, lambda: router)

    def holds(replica: str, conv: int) -> int:
        return router.matches([replica], prompt(conv))[replica].blocks

    async def scenario() -> None:
        engines["a"].store(prompt(0))
        await puller.pull_once()  # the first read of each replica: a snapshot
        assert [e.snapshots for e in engines.values()] == [1, 1]
        assert holds("a", 0) == 3 and holds("b", 0) == 0
        engines["a"].store(prompt(1))
        await puller.pull_once()  # a delta
        assert engines["a"].snapshots == 1 and holds("a", 1) == 3
        fleet.lose_next.add("a")
        engines["a"].store(prompt(2))
        await puller.pull_once()  # lost: prompt 2's events went with it
        assert holds("a", 2) == 0
        await puller.pull_once()  # the replica sees the old sequence number: a snapshot
        assert engines["a"].snapshots == 2 and holds("a", 2) == 3
        engines["b"].store(prompt(3))
        engines["b"].store(prompt(4))  # the log keeps one batch: prompt 3's is dropped
        await puller.pull_once()
        assert engines["b"].snapshots == 2 and holds("b", 3) == holds("b", 4) == 3
        fleet.down.add("b")
        engines["a"].store(prompt(5))
        await puller.pull_once()  # b fails; a is still fed
        assert holds("a", 5) == 3

    asyncio.run(scenario())


def test_a_replica_without_kv_events_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the replicas' KV events"):
        KVEventFeed(SimpleNamespace(kv_events=None))
