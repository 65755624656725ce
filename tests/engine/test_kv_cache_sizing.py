"""How many KV blocks an engine gets on the CPU: by default room for max_num_seqs sequences of
max_model_len tokens, at most 4 GiB and a quarter of available memory; an explicit byte count or
fraction, or --num-gpu-blocks, wins. Each choice is logged with its reason."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from conveyor.distributed.group import ParallelConfig
from conveyor.engine import llm_engine
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import DEFAULT_CPU_KV_CACHE_BYTES, _num_blocks

BLOCK_BYTES = 2**20
GiB = 2**30


@pytest.fixture
def executor(monkeypatch):
    monkeypatch.setattr(llm_engine, "_available_memory", lambda device: 64 * GiB)
    return SimpleNamespace(device=torch.device("cpu"), parallel=ParallelConfig(),
                           kv_cache_groups=(),
                           kv_cache_bytes_per_block=lambda block_size: BLOCK_BYTES)


def test_the_default_fits_the_work(executor, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor.engine"):
        blocks, _ = _num_blocks(EngineArgs(max_num_seqs=4, block_size=16), executor, 2000)
    assert blocks == 4 * 125
    assert "room for --max-num-seqs 4 sequences of 2000 tokens" in caplog.text


def test_the_default_is_at_most_4_gib_and_a_quarter_of_memory(executor, monkeypatch,
                                                               caplog) -> None:
    args = EngineArgs(max_num_seqs=64)
    with caplog.at_level(logging.INFO, logger="conveyor.engine"):
        assert _num_blocks(args, executor, 8192)[0] == DEFAULT_CPU_KV_CACHE_BYTES // BLOCK_BYTES
    assert "at most 4 GiB" in caplog.text
    monkeypatch.setattr(llm_engine, "_available_memory", lambda device: 8 * GiB)
    assert _num_blocks(args, executor, 8192)[0] == 2 * GiB // BLOCK_BYTES


def test_explicit_sizes_win(executor) -> None:
    args = EngineArgs(max_num_seqs=1)
    assert _num_blocks(args.replace(kv_cache_memory=300 * BLOCK_BYTES), executor, 16)[0] == 300
    assert _num_blocks(args.replace(kv_cache_memory=0.5), executor, 16)[0] == 32 * GiB // BLOCK_BYTES
    assert _num_blocks(args.replace(num_gpu_blocks=7), executor, 16)[0] == 7
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0"):
        _num_blocks(args.replace(kv_cache_memory=0), executor, 16)
