"""The KV connector's scheduler side without torch: content keys, the tiered offload index
(LRU per tier, moves down, drops, exact lookups, lost entries) and KV events."""

from __future__ import annotations

from hashlib import blake2b

from conveyor.core.kv_connector.events import (
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from conveyor.core.kv_connector.interface import (
    DropBlock,
    KVConnectorOutput,
    LoadBlocks,
    LostEntry,
    MoveBlock,
    SaveBlock,
)
from conveyor.core.kv_connector.keys import BlockRecord, block_key, extend_block_keys, root_key
from conveyor.core.kv_connector.offload import TieredOffloadScheduler
from conveyor.core.sampling_params import SamplingParams

NS = b"test-namespace"
ROOT = root_key(NS, 0)
BS = 4
SP = SamplingParams(max_tokens=3, ignore_eos=True)


def record(tokens: tuple[int, ...], parent: bytes = ROOT) -> BlockRecord:
    return BlockRecord(block_key(parent, tokens), parent, tokens)


# ---------------------------------------------------------------------- keys


def test_a_key_names_the_whole_prefix_in_its_namespace():
    tokens = list(range(1, 9))
    keys = extend_block_keys([], tokens, BS, 2, ROOT)
    assert keys[0] == blake2b(ROOT + b"".join(t.to_bytes(4, "little") for t in tokens[:4]),
                              digest_size=16).digest()
    other_first = extend_block_keys([], [9] + tokens[1:], BS, 2, ROOT)
    assert other_first[1] != keys[1]  # same tokens in block 1, another prefix before them
    assert extend_block_keys([], tokens, BS, 2, root_key(b"other model", 0)) != keys
    assert extend_block_keys([], tokens, BS, 2, root_key(NS, 3)) != keys  # a LoRA adapter's
    assert extend_block_keys(keys[:1], tokens, BS, 2, ROOT) == keys


# ---------------------------------------------------------------------- the tier index


def test_tiers_save_move_down_drop_and_look_up_exactly():
    log = KVEventLog(2)
    conn = TieredOffloadScheduler(cpu_blocks=2, disk_blocks=2, block_size=2, root=ROOT,
                                  events=log)
    r = [record((i, i + 1)) for i in range(5)]
    for block, rec in enumerate(r[:4]):
        conn.block_evicted(block, rec)
    conn.block_evicted(9, r[3])  # stored already: only used
    conn.block_evicted(4, r[4])  # host full -> r2 moves down; disk full -> r0 dropped
    ops = conn.build_metadata().ops
    assert [type(op) for op in ops] == [SaveBlock, SaveBlock, MoveBlock, SaveBlock, MoveBlock,
                                        SaveBlock, DropBlock, MoveBlock, SaveBlock]
    assert ops[-3] == DropBlock(r[0].key, "disk")
    assert ops[-2].key == r[2].key and (ops[-2].source, ops[-2].dest) == ("cpu", "disk")
    assert conn.build_metadata() is None
    s = conn.stats
    assert (s.blocks_cpu, s.blocks_disk, s.saved_blocks, s.moved_blocks) == (2, 2, 5, 3)
    # exact lookups: key, tokens and parent must all match; the walk stops at the first miss
    assert conn.lookup([r[4], r[1]]) == [r[4], r[1]]
    assert conn.lookup([r[0], r[4]]) == []
    assert conn.lookup([BlockRecord(r[4].key, r[4].parent, (7, 7))]) == []
    assert conn.lookup([BlockRecord(r[4].key, r[1].key, r[4].token_ids)]) == []
    # a report of a lost copy removes that copy only (the serial names it)
    save_r4 = next(op for op in ops if isinstance(op, SaveBlock) and op.record == r[4])
    conn.update(KVConnectorOutput(lost=[LostEntry(r[4].key, "cpu", save_r4.serial + 100, "x")]))
    assert conn.lookup([r[4]]) == [r[4]]
    conn.update(KVConnectorOutput(lost=[LostEntry(r[4].key, "cpu", save_r4.serial, "corrupt")]))
    assert conn.lookup([r[4]]) == [] and conn.stats.lost_blocks == 2
    log.flush(1.0)
    events = log.drain()[0].events
    assert events[0] == BlockStored([r[0].key], None, [0, 1], 2, 0, "cpu")
    assert BlockRemoved([r[0].key], "disk") in events
    assert events[-1] == BlockRemoved([r[4].key], "cpu")


def test_a_load_touches_its_entries_and_reports_hits_per_tier():
    conn = TieredOffloadScheduler(cpu_blocks=1, disk_blocks=4, block_size=2, root=ROOT)
    a = record((1, 2))
    b = record((3, 4), a.key)
    conn.block_evicted(0, a)
    conn.block_evicted(1, b)  # a moves to disk
    conn.build_metadata()
    assert conn.lookup([a, b]) == [a, b]
    conn.start_load(7, [5, 6], [a, b])
    (load,) = conn.build_metadata().ops
    assert isinstance(load, LoadBlocks) and [(i.block, i.tier) for i in load.items] == \
        [(5, "disk"), (6, "cpu")]
    conn.update(KVConnectorOutput(finished_loads={7: 1}))  # the second block did not arrive
    s = conn.stats
    assert (s.hits_disk, s.hits_cpu, s.loaded_blocks) == (2, 0, 1)


def test_the_event_log_coalesces_runs_queues_and_calls_subscribers():
    log = KVEventLog(2, max_pending=2)
    seen = []
    unsubscribe = log.subscribe(seen.append)
    a = record((1, 2))
    b = record((3, 4), a.key)
    log.stored("pool", a, True)
    log.stored("pool", b, False)
    log.removed("pool", a.key)
    log.removed("pool", b.key)
    log.flush(1.0)
    assert seen[0].events == [BlockStored([a.key, b.key], None, [1, 2, 3, 4], 2, 0, "pool"),
                              BlockRemoved([a.key, b.key], "pool")]
    unsubscribe()
    log.cleared("cpu")
    log.flush(2.0)
    log.flush(3.0)  # nothing recorded: no batch
    log.stored("cpu", a, True)
    log.flush(4.0)
    assert len(seen) == 1 and log.dropped == 1
    assert [b.ts for b in log] == [2.0, 4.0] and log.drain() == []
