"""The KV connector's scheduler side without torch: content keys, the tiered offload index
(LRU per tier, moves down, drops, exact lookups, lost entries), KV events, and the scheduler
loading prefixes from the tiers through a fake runner half over the fake executor's simulated
cache (which checks every K/V read): tokens equal a run without tiers, hits come from the tiers,
aborts and corrupt entries mid-load, invariants after every step."""

from __future__ import annotations

import itertools
import random
from hashlib import blake2b

import pytest
from core_fakes import (
    EOS,
    FakeConnectorRunner,
    FakeExecutor,
    check_invariants,
    connector_step,
    reference_outputs,
)

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.kv_connector.events import (
    AllBlocksCleared,
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
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import SequenceStatus

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


# ---------------------------------------------------------------------- the scheduler


def offload_scheduler(policy: str, num_gpu_blocks: int, cpu: int, disk: int,
                      num_cpu_blocks: int = 0,
                      **kw) -> tuple[Scheduler, TieredOffloadScheduler, KVEventLog]:
    log = KVEventLog(BS)
    conn = TieredOffloadScheduler(cpu, disk, BS, ROOT, log)
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64,
           "policy": policy, **kw}
    ticks = itertools.count(1)
    sched = Scheduler(SchedulerConfig(**cfg), CacheConfig(BS, num_gpu_blocks, num_cpu_blocks),
                      eos_token_ids=(EOS,), clock=lambda: float(next(ticks)),
                      kv_connector=conn, kv_events=log, kv_key_namespace=NS)
    return sched, conn, log


def run(sched, ex, runner, requests, abort=None, max_steps=5000):
    """Add ``requests`` ((id, prompt[, priority])), step to the end (checking invariants);
    ``abort(step)`` may name a request to abort before that step. Finished groups by id."""
    for rid, prompt, *priority in requests:
        sched.add_request(rid, prompt, SP, priority=priority[0] if priority else 0)
    done = {}
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return done
        rid = abort(n) if abort else None
        if rid is not None and sched.abort(rid) is not None:
            done[rid] = None
        _, finished = connector_step(sched, ex, runner)
        for g in finished:
            assert g.request_id not in done
            done[g.request_id] = g
        check_invariants(sched)
    raise AssertionError("no completion")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 23) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_working_set_larger_than_the_pool_loads_from_the_tiers(policy, max_num_seqs):
    sched, conn, _ = offload_scheduler(policy, num_gpu_blocks=10, cpu=4, disk=12,
                                       max_num_seqs=max_num_seqs)
    ex = FakeExecutor(sched)
    runner = FakeConnectorRunner(ex, load_delay=2)
    ps = prompts(5, 14, seed=1)  # 3 full blocks + 2 tokens each: 15 full blocks in all
    for rnd in range(2):
        done = run(sched, ex, runner, [(f"{rnd}-{i}", p) for i, p in enumerate(ps)])
        for i, p in enumerate(ps):
            assert done[f"{rnd}-{i}"].seqs[0].output_token_ids == reference_outputs(p, SP, 64)[0]
    s = conn.stats
    assert s.loaded_blocks and s.loaded_blocks * BS == s.hits_cpu + s.hits_disk
    if max_num_seqs == 1:  # no other request evicts a loaded block before it is admitted
        assert s.loaded_blocks == 15  # round 2 finds every prompt block in a tier
        assert sched.stats.prefix_cache_hits >= s.hits_cpu + s.hits_disk  # pool hits too
    assert sched.block_manager.gpu.num_free == 10


def test_a_corrupt_entry_is_a_miss_and_is_computed_again():
    sched, conn, _ = offload_scheduler("chunked", num_gpu_blocks=8, cpu=16, disk=0)
    ex = FakeExecutor(sched)
    runner = FakeConnectorRunner(ex)
    ps = prompts(3, 14, seed=2)
    run(sched, ex, runner, [(f"a{i}", p) for i, p in enumerate(ps)])
    for key in list(runner.tiers["cpu"]):
        runner.corrupt(key)
    done = run(sched, ex, runner, [(f"b{i}", p) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert done[f"b{i}"].seqs[0].output_token_ids == reference_outputs(p, SP, 64)[0]
    assert conn.stats.lost_blocks > 0


def test_aborting_a_loading_request_frees_its_blocks_once_the_load_is_done():
    sched, conn, _ = offload_scheduler("prefill_first", num_gpu_blocks=8, cpu=16, disk=0)
    ex = FakeExecutor(sched)
    runner = FakeConnectorRunner(ex, load_delay=3)
    ps = prompts(5, 14, seed=3)
    run(sched, ex, runner, [(f"a{i}", p) for i, p in enumerate(ps)])
    sched.add_request("b", ps[0], SP)
    connector_step(sched, ex, runner)
    (seq,) = sched.loading.values()
    assert seq.status is SequenceStatus.WAITING_FOR_KV
    assert sched.abort("b") is not None
    assert seq.block_tables and sched.has_unfinished_requests()  # held: the load may write
    check_invariants(sched)
    while sched.has_unfinished_requests():
        connector_step(sched, ex, runner)
        check_invariants(sched)
    assert sched.block_manager.gpu.num_free == 8 and not seq.block_tables


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_keep_tokens_and_invariants(seed):
    rng = random.Random(seed)
    policy = rng.choice(["prefill_first", "chunked"])
    swap = rng.random() < 0.5
    sched, conn, _ = offload_scheduler(policy, num_gpu_blocks=rng.randint(8, 14),
                                       cpu=rng.randint(0, 6), disk=rng.randint(1, 10),
                                       num_cpu_blocks=8 if swap else 0,
                                       preemption_mode="swap" if swap else "recompute",
                                       queue=rng.choice(["fcfs", "priority"]),
                                       max_num_seqs=rng.randint(1, 4))
    ex = FakeExecutor(sched)
    runner = FakeConnectorRunner(ex, load_delay=rng.randint(1, 3))
    shared = prompts(4, 9, seed)
    requests = []
    for i in range(24):
        p = rng.choice(shared) + [rng.randrange(1, 23) for _ in range(rng.randint(1, 10))]
        requests.append((f"r{i}", p, rng.randrange(3)))
    aborts = {rng.randrange(60): f"r{rng.randrange(24)}" for _ in range(3)}

    def abort(step):
        if step % 17 == 5 and runner.tiers["cpu"]:
            runner.corrupt(rng.choice(list(runner.tiers["cpu"])))
        return aborts.get(step)

    done = {}
    for k in range(0, 24, 6):
        done.update(run(sched, ex, runner, requests[k:k + 6], abort))
    for rid, p, _ in requests:
        if done[rid] is not None and not any(s.status is SequenceStatus.FINISHED_ABORTED
                                             for s in done[rid].seqs):
            assert done[rid].seqs[0].output_token_ids == reference_outputs(p, SP, 64)[0], rid
    assert sched.block_manager.gpu.num_free == sched.block_manager.gpu.num_blocks


def test_events_of_a_simple_scenario():
    sched, conn, log = offload_scheduler("prefill_first", num_gpu_blocks=4, cpu=4, disk=0,
                                         max_num_seqs=1)
    ex = FakeExecutor(sched)
    runner = FakeConnectorRunner(ex)
    a, b = prompts(1, 9, seed=4)[0], prompts(1, 13, seed=5)[0]  # 2 and 3 full blocks + 1
    run(sched, ex, runner, [("a", a)])
    ka = extend_block_keys([], a, BS, 2, ROOT)
    (batch,) = log.drain()  # the admission's step: its two full blocks, one run
    assert batch.events == [BlockStored(ka, None, a[:8], BS, 0, "pool")]
    run(sched, ex, runner, [("b", b)])  # b takes the whole pool: a's blocks go to the tier
    events = [e for batch in log.drain() for e in batch.events]
    kb = extend_block_keys([], b, BS, 3, ROOT)
    assert BlockRemoved(ka[::-1], "pool") in events  # a's tail was freed, so evicted, first
    assert BlockStored([ka[1]], ka[0], a[4:8], BS, 0, "cpu") in events
    assert BlockStored([ka[0]], None, a[:4], BS, 0, "cpu") in events
    assert BlockStored(kb, None, b[:12], BS, 0, "pool") in events
    assert sched.clear_prefix_cache()
    sched.schedule()  # carries the tier's clear
    log.flush(9.0)
    (batch,) = log.drain()
    assert batch.events == [AllBlocksCleared("pool"), AllBlocksCleared("cpu")]
    assert conn.stats.blocks_cpu == 0
