"""KV offload on the real model (SmolLM2, float32, a pool of six blocks so that four requests
evict): greedy tokens are identical with and without the tiers while the hits come from
them; a second engine reads what the first left in the disk tier; a corrupt and a truncated
block file are detected, removed and computed again, with the same tokens; KV events of a
simple scenario; bad options are refused with clear errors."""

from __future__ import annotations

import argparse
import copy
import os
import random
from types import SimpleNamespace

import pytest
import torch

from conveyor.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from conveyor.core.kv_connector.events import BlockRemoved, BlockStored
from conveyor.core.kv_connector.keys import extend_block_keys, root_key
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs, add_cli_args, from_cli_args
from conveyor.engine.kv_offload import setup_kv_connector
from conveyor.engine.llm_engine import LLMEngine
from conveyor.executor.kv_block_file import header_size
from conveyor.routing import KVIndex
from engine_runs import run_to_end

BLOCK = 16
POOL = 6  # blocks: a request takes four
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four prompts of 3 full blocks + 4 tokens: a shared 2-block prefix, then their own. Run
    one after another, each takes two new blocks and leaves one cached: the fourth evicts the
    first one's own block."""
    rng = random.Random(48)
    shared = [rng.randrange(100, 40000) for _ in range(2 * BLOCK)]
    return [shared + [rng.randrange(100, 40000) for _ in range(BLOCK + 4)] for _ in range(4)]


@pytest.fixture(scope="module")
def fillers() -> list[list[int]]:
    """Two unrelated prompts that, run after the others, evict every block they left."""
    rng = random.Random(49)
    return [[rng.randrange(100, 40000) for _ in range(3 * BLOCK + 4)] for _ in range(2)]


def make_engine(llm, **kwargs) -> LLMEngine:
    args = EngineArgs(num_gpu_blocks=POOL, block_size=BLOCK, max_model_len=256, max_num_seqs=2,
                      max_num_batched_tokens=256, seed=0, dtype="float32", **kwargs)
    return LLMEngine(args, executor=copy.copy(llm.llm_engine.executor))


def stored_bytes(engine: LLMEngine) -> int:
    """Bytes one block takes in a tier (its contents and its header)."""
    return engine.executor.kv_cache_bytes_per_block(BLOCK) + header_size(BLOCK)


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """The prompts one after another, each alone."""
    tokens = []
    for i, p in enumerate(prompts):
        (out,) = run_to_end(engine, [({"prompt_token_ids": p}, GREEDY)], f"{tag}{i}-")
        tokens.append(out.outputs[0].token_ids)
    return tokens


def block_file(engine: LLMEngine, disk: str, prompt: list[int], j: int) -> str:
    keys = extend_block_keys([], prompt, BLOCK, j + 1, root_key(engine.kv_key_namespace, 0))
    return os.path.join(disk, engine.kv_key_namespace.hex(), keys[j].hex() + ".kvb")


def test_tokens_are_identical_with_and_without_offload(llm, prompts):
    plain = make_engine(llm)
    expected = generate(plain, prompts, "a")
    assert generate(plain, prompts, "b") == expected  # its own prefix hits change nothing
    engine = make_engine(llm, kv_offload_cpu_bytes=16 * stored_bytes(plain))
    try:
        assert generate(engine, prompts, "a") + generate(engine, prompts, "b") == 2 * expected
        stats = engine.get_stats()
        kv = stats.kv_offload
        assert kv.hits_cpu >= len(prompts) * BLOCK and kv.hits_disk == 0  # an own block each
        assert kv.lost_blocks == 0 and kv.loaded_blocks * BLOCK == kv.hits_cpu
        assert stats.scheduler.prefix_cache_hits > plain.get_stats().scheduler.prefix_cache_hits
        assert stats.scheduler.num_free_blocks == POOL
    finally:
        engine.shutdown()


def test_a_second_engine_reads_the_disk_tier_the_first_wrote(llm, prompts, fillers, tmp_path):
    disk = str(tmp_path / "kv")
    first = make_engine(llm, kv_offload_disk=disk, kv_offload_disk_bytes=64 * 2**20)
    expected = generate(first, prompts, "a")
    generate(first, fillers, "f")
    first.shutdown()  # its queued writes finish
    assert first.get_stats().kv_offload.blocks_disk > 0
    second = make_engine(llm, kv_offload_disk=disk, kv_offload_disk_bytes=64 * 2**20)
    try:
        assert second.get_stats().kv_offload.blocks_disk == first.get_stats().kv_offload.blocks_disk
        assert generate(second, prompts, "b") == expected
        kv = second.get_stats().kv_offload  # the first prompt loads all three blocks; the
        assert kv.hits_disk >= (2 + len(prompts)) * BLOCK  # others their own, the prefix hits
        assert kv.hits_cpu == 0 and kv.lost_blocks == 0
    finally:
        second.shutdown()


def test_a_corrupt_and_a_truncated_block_file_are_misses(llm, prompts, fillers, tmp_path):
    disk = str(tmp_path / "kv")
    first = make_engine(llm, kv_offload_disk=disk, kv_offload_disk_bytes=64 * 2**20)
    expected = generate(first, prompts, "a")
    generate(first, fillers, "f")
    first.shutdown()
    corrupt, truncated = block_file(first, disk, prompts[0], 2), block_file(first, disk, prompts[1], 2)
    assert os.path.exists(corrupt) and os.path.exists(truncated)
    with open(corrupt, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 1000)
    second = make_engine(llm, kv_offload_disk=disk, kv_offload_disk_bytes=64 * 2**20)
    try:
        assert generate(second, prompts[:1], "b") == expected[:1]
        assert not os.path.exists(corrupt)
        assert generate(second, prompts[1:2], "c") == expected[1:2]
        assert not os.path.exists(truncated)
        kv = second.get_stats().kv_offload
        assert kv.lost_blocks == 2 and kv.hits_disk >= 2 * BLOCK  # the shared prefix loaded
        assert generate(second, prompts, "d") == expected
    finally:
        second.shutdown()


def test_kv_events_of_a_simple_scenario(llm, prompts):
    engine = make_engine(llm, kv_events=True, kv_offload_cpu_bytes=16 * 2**20)
    try:
        seen = []
        engine.kv_events.subscribe(seen.append)
        root = root_key(engine.kv_key_namespace, 0)
        generate(engine, prompts[:1], "a")
        keys = extend_block_keys([], prompts[0], BLOCK, 3, root)
        (batch,) = engine.kv_events.drain()  # its 3 full prompt blocks, computed in one step
        assert batch.events == [BlockStored(keys, None, prompts[0][:3 * BLOCK], BLOCK, 0, "pool")]
        assert seen == [batch]
        generate(engine, prompts[1:], "b")  # the fourth prompt evicts prompt 0's own block
        events = [e for b in engine.kv_events.drain() for e in b.events]
        removed = [k for e in events if isinstance(e, BlockRemoved) and e.tier == "pool"
                   for k in e.block_hashes]
        cpu = [k for e in events if isinstance(e, BlockStored) and e.tier == "cpu"
               for k in e.block_hashes]
        assert keys[2] in removed and keys[2] in cpu
        assert engine.reset_prefix_cache()
        (batch,) = engine.kv_events.drain()
        assert [(type(e).__name__, e.tier) for e in batch.events] == [
            ("AllBlocksCleared", "pool"), ("AllBlocksCleared", "cpu")]
        assert engine.get_stats().kv_offload.blocks_cpu == 0
    finally:
        engine.shutdown()


def test_a_snapshot_rebuilds_what_the_event_stream_built(llm, prompts, fillers):
    """An index fed every batch and one rebuilt from ``kv_events_snapshot`` agree, pool and
    host-memory tier alike; the snapshot empties the log's queue."""
    engine = make_engine(llm, kv_events=True, kv_offload_cpu_bytes=16 * 2**20)
    try:
        streamed = KVIndex()
        engine.kv_events.subscribe(lambda batch: streamed.apply("r", batch.events))
        generate(engine, prompts + fillers[:1], "s")
        batch = engine.kv_events_snapshot()
        assert engine.kv_events.drain() == []
        rebuilt = KVIndex()
        rebuilt.apply("r", batch.events)
        for tier in ("pool", "cpu"):
            assert rebuilt.num_blocks("r", tier) == streamed.num_blocks("r", tier) > 0
        root = root_key(engine.kv_key_namespace, 0)
        for p in prompts + fillers:
            keys = extend_block_keys([], p, BLOCK, len(p) // BLOCK, root)
            assert rebuilt.match(keys, ["r"]) == streamed.match(keys, ["r"])
            assert all(rebuilt.holders(k) == streamed.holders(k) for k in keys)
    finally:
        engine.shutdown()
    plain = make_engine(llm)
    try:
        with pytest.raises(ValueError, match="KV events are off"):
            plain.kv_events_snapshot()
    finally:
        plain.shutdown()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_offload_cpu_bytes": -1}, "--kv-offload-cpu-bytes must be an integer number of bytes"),
    ({"kv_offload_cpu_bytes": 1000}, "--kv-offload-cpu-bytes 1000 holds no KV block"),
    ({"kv_offload_disk_bytes": 2**30}, "--kv-offload-disk-bytes needs --kv-offload-disk PATH"),
    ({"kv_offload_disk": "/tmp/x"}, "needs --kv-offload-disk-bytes N > 0"),
    ({"kv_offload_cpu_bytes": 2**30, "enable_prefix_caching": False},
     "needs --enable-prefix-caching"),
    ({"kv_offload_cpu_bytes": 2**30, "speculative_method": "draft_model"},
     "does not support --speculative-method draft_model"),
])
def test_bad_options_are_refused_clearly(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_engine(llm, **kwargs)


def test_a_disk_path_that_is_a_file_is_refused(llm, tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        make_engine(llm, kv_offload_disk=str(path), kv_offload_disk_bytes=2**30)


@pytest.mark.parametrize(("executor", "args", "message"), [
    (SimpleNamespace(device=torch.device("cuda:0"), kv_cache_groups=()), {}, "CPU device only"),
    (SimpleNamespace(device=torch.device("cpu"), kv_cache_groups=(
        KVCacheGroup(FullAttentionSpec(), (0,)), KVCacheGroup(SlidingWindowSpec(8), (1,)))),
     {}, "does not support hybrid KV caches"),
    (SimpleNamespace(device=torch.device("cpu"), kv_cache_groups=()), {"tensor_parallel_size": 2},
     "does not support tensor parallelism"),
])
def test_unsupported_set_ups_are_refused_at_start(executor, args, message):
    with pytest.raises(ValueError, match=message):
        setup_kv_connector(EngineArgs(kv_offload_cpu_bytes=2**30, **args), executor)


def test_the_command_line_flags():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = from_cli_args(parser.parse_args([
        "--kv-offload-cpu-bytes", "4000000000", "--kv-offload-disk", "/var/kv",
        "--kv-offload-disk-bytes", "100000000000", "--kv-events"]))
    assert (args.kv_offload_cpu_bytes, args.kv_offload_disk, args.kv_offload_disk_bytes,
            args.kv_events) == (4_000_000_000, "/var/kv", 100_000_000_000, True)
    defaults = from_cli_args(parser.parse_args([]))
    assert (defaults.kv_offload_cpu_bytes, defaults.kv_offload_disk, defaults.kv_events) == \
        (0, None, False)
