"""KVIndex on synthetic KV events (stores, removals, tiers, clears, a snapshot after missed
batches) and the kv_aware router over it: the longest held prefix wins unless the load penalty
outweighs it, tiers weigh less than the pool, keys match the engine's."""

from __future__ import annotations

import pytest

from conveyor.core.kv_connector.events import (
    CPU,
    DISK,
    POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from conveyor.core.kv_connector.keys import BlockRecord, extend_block_keys, root_key
from conveyor.routing import KVIndex, make_router

BS = 4
NS = b"n" * 16


def keys_of(tokens: list[int], lora_id: int = 0) -> list[bytes]:
    return extend_block_keys([], tokens, BS, len(tokens) // BS, root_key(NS, lora_id))


def stored(keys: list[bytes], tier: str = POOL) -> BlockStored:
    return BlockStored(list(keys), None, [0] * BS * len(keys), BS, 0, tier)


def prompt(conv: int, blocks: int) -> list[int]:
    return [1000 * conv + i for i in range(blocks * BS)]


def test_store_match_and_remove() -> None:
    idx = KVIndex()
    k = keys_of(prompt(1, 4))
    idx.apply("a", [stored(k[:3])])
    idx.apply("b", [stored(k[:1])])
    m = idx.match(k, ["a", "b", "c"])
    assert (m["a"].blocks, m["b"].blocks, m["c"].blocks) == (3, 1, 0)
    idx.apply("a", [BlockRemoved([k[1]], POOL)])  # a hole ends the prefix
    assert idx.match(k, ["a"])["a"].blocks == 1
    assert idx.num_blocks("a") == 2
    idx.apply("a", [BlockRemoved([k[1]], POOL)])  # removing an absent key changes nothing
    assert idx.num_blocks("a") == 2


def test_tiers_are_tracked_apart() -> None:
    idx = KVIndex()
    k = keys_of(prompt(1, 3))
    idx.apply("a", [stored(k[:2]), BlockRemoved([k[1]], POOL), stored([k[1]], CPU),
                    stored([k[2]], DISK)])
    m = idx.match(k, ["a"])["a"]
    assert m.blocks == 3 and m.per_tier == (1, 1, 1)
    assert idx.holders(k[1]) == {"a": (CPU,)}
    idx.apply("a", [stored([k[1]], POOL)])  # loaded back: the pool serves it first
    assert idx.match(k, ["a"])["a"].per_tier == (2, 0, 1)
    idx.apply("a", [AllBlocksCleared(CPU)])
    assert idx.holders(k[1]) == {"a": (POOL,)}
    idx.apply("a", [AllBlocksCleared(POOL)])
    m = idx.match(k, ["a"])["a"]
    assert m.blocks == 0  # the first block is gone everywhere
    assert idx.num_blocks("a", DISK) == 1


def test_clear_of_one_replica_leaves_the_others() -> None:
    idx = KVIndex()
    k = keys_of(prompt(1, 2))
    idx.apply("a", [stored(k)])
    idx.apply("b", [stored(k)])
    idx.apply("a", [AllBlocksCleared(POOL)])
    assert idx.holders(k[0]) == {"b": (POOL,)}
    idx.reset("b")
    assert idx.holders(k[0]) == {}


def test_unknown_tier_and_event_are_refused() -> None:
    idx = KVIndex()
    with pytest.raises(ValueError, match="unknown KV tier"):
        idx.apply("a", [stored(keys_of(prompt(1, 1)), "gpu2")])
    with pytest.raises(ValueError, match="not a KV event"):
        idx.apply("a", [object()])  # type: ignore[list-item]


def _records(tokens: list[int]) -> list[BlockRecord]:
    keys = keys_of(tokens)
    root = root_key(NS, 0)
    return [BlockRecord(keys[j], keys[j - 1] if j else root,
                        tuple(tokens[j * BS:(j + 1) * BS])) for j in range(len(keys))]


def test_a_reader_that_missed_batches_rebuilds_from_a_snapshot() -> None:
    """A log that dropped batches: the reader's view is wrong until it resets the replica and
    applies a snapshot; batches published after the snapshot then keep it exact."""
    log = KVEventLog(BS, max_pending=2)
    full = KVIndex()  # sees every batch (a subscriber)
    log.subscribe(lambda batch: full.apply("a", batch.events))
    late = KVIndex()  # drains the queue, too rarely
    root = root_key(NS, 0)
    held: dict[bytes, None] = {}

    def step(conv: int) -> None:  # stores one conversation, evicts the previous one
        for rec in _records(prompt(conv, 3)):
            log.stored(POOL, rec, rec.parent == root)
            held[rec.key] = None
        if conv:
            for rec in _records(prompt(conv - 1, 3)):
                log.removed(POOL, rec.key)
                del held[rec.key]
        log.flush(float(conv))

    step(0)
    for batch in log.drain():
        late.apply("a", batch.events)
    for conv in range(1, 6):
        step(conv)
    assert log.dropped == 3
    for batch in log.drain():  # batches 4 and 5: the removal of conversation 0 was missed
        late.apply("a", batch.events)
    stale = keys_of(prompt(0, 3))
    assert late.match(stale, ["a"])["a"].blocks == 3
    assert full.match(stale, ["a"])["a"].blocks == 0
    late.reset("a")
    late.apply("a", [AllBlocksCleared(POOL), stored(list(held))])  # the snapshot
    step(6)
    for batch in log.drain():
        late.apply("a", batch.events)
    for conv in range(7):
        k = keys_of(prompt(conv, 3))
        assert late.match(k, ["a"])["a"] == full.match(k, ["a"])["a"]
    assert late.match(keys_of(prompt(6, 3)), ["a"])["a"].blocks == 3


# -- the router --------------------------------------------------------------------------------


def kv_router(**kwargs):
    r = make_router("kv_aware", block_size=BS, **kwargs)
    for name in ("a", "b"):
        r.set_namespace(name, NS)
    return r


def test_kv_aware_routes_to_the_longest_held_prefix() -> None:
    r = kv_router()
    p = prompt(7, 6)
    r.apply("b", [stored(keys_of(p)[:5])])
    r.apply("a", [stored(keys_of(p)[:2])])
    d = r.route(["a", "b"], p, {"a": 0, "b": 0})
    assert d.replica == "b" and d.matched_blocks == 5 and d.affinity_hit
    # the load penalty (2 blocks a request): b holds 3 blocks more than a
    d = r.route(["a", "b"], p, {"a": 0, "b": 1})  # 1 request more costs 2 < 3
    assert d.replica == "b"
    d = r.route(["a", "b"], p, {"a": 0, "b": 2})  # 2 more cost 4 > 3: a wins
    assert d.replica == "a" and d.matched_blocks == 2


def test_kv_aware_without_holders_is_least_loaded_and_rotates_ties() -> None:
    r = kv_router()
    assert r.route(["a", "b"], prompt(1, 2), {"a": 2, "b": 1}).replica == "b"
    picks = {r.route(["a", "b"], prompt(1, 2), {}).replica for _ in range(2)}
    assert picks == {"a", "b"}
    assert not r.route(["a", "b"], prompt(1, 2), {}).affinity_hit


def test_kv_aware_weighs_offload_tiers_below_the_pool() -> None:
    r = kv_router(load_weight=0.0)
    p = prompt(3, 4)
    k = keys_of(p)
    r.apply("a", [stored(k[:3], POOL)])
    r.apply("b", [stored(k, CPU)])  # 4 * 0.75 = 3.0 ties with a's 3 pool blocks
    assert r.route(["a", "b"], p, {"a": 1, "b": 0}).replica == "b"  # tie: the less loaded
    r.apply("b", [BlockRemoved([k[3]], CPU), stored([k[3]], DISK)])  # 3*0.75 + 0.5 < 3
    assert r.route(["a", "b"], p, {"a": 1, "b": 0}).replica == "a"


def test_kv_aware_keys_follow_the_adapter_and_namespace() -> None:
    r = kv_router()
    p = prompt(2, 3)
    r.apply("a", [stored(keys_of(p, lora_id=5))])
    assert r.route(["a", "b"], p, {"a": 0, "b": 0}, adapter=5).replica == "a"
    assert r.matches(["a", "b"], p)["a"].blocks == 0  # the base model's keys differ
    r.set_namespace("a", b"m" * 16)  # another model: what a held is forgotten
    assert r.matches(["a", "b"], p, adapter=5)["a"].blocks == 0
    r.remove("b")
    assert r.matches(["a", "b"], p)["b"].blocks == 0


def test_kv_aware_knows_nothing_of_a_replica_without_namespace() -> None:
    r = make_router("kv_aware", block_size=BS)
    p = prompt(1, 2)
    r.apply("a", [stored(keys_of(p))])
    assert r.matches(["a"], p)["a"].blocks == 0
    r.set_namespace("a", NS)
    assert r.matches(["a"], p)["a"].blocks == 2


def test_kv_aware_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="load_weight"):
        make_router("kv_aware", load_weight=-1)
    with pytest.raises(ValueError, match="unknown tiers"):
        make_router("kv_aware", tier_weights={"gpu": 1.0})
    with pytest.raises(ValueError, match="block_size"):
        make_router("kv_aware", block_size=0)
