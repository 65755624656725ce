"""Gemma-style hybrid KV in the simulator: the spec's window layers become the engine's KV-cache
groups, blocks are sized per group, and the scheduler admits as the engine's does; the
hybrid-versus-uniform capacity figure of docs/kv_cache.md."""

import numpy as np
import pytest

from conveyor.core.kv_cache_spec import kv_cache_groups
from conveyor.sim.cost_model import CostModel
from conveyor.sim.kv_capacity import compare, main
from conveyor.sim.runner import SimConfig, build, simulate
from conveyor.sim.specs import load_hardware, load_model
from conveyor.sim.workload import Workload

GEMMA, L4 = load_model("gemma3-270m"), load_hardware("l4")


def test_gemma_spec_has_three_global_and_fifteen_window_layers():
    assert GEMMA.num_params / 1e6 == pytest.approx(268, rel=0.01)
    windows = GEMMA.attention_windows
    assert windows.count(0) == 3 and windows.count(512) == 15 and windows[5] == windows[17] == 0
    assert load_model("smollm2-135m").attention_windows == [0] * 30


def test_blocks_hold_one_groups_layers():
    cost = CostModel(GEMMA, L4, block_size=16)
    assert cost.kv_cache_groups == kv_cache_groups(GEMMA.attention_windows)
    assert cost.block_bytes == 2 * 3 * 1 * 256 * 2 * 16  # 3 layers of 1 KV head x 256, bf16
    assert cost.num_gpu_blocks() == int(cost.kv_cache_bytes // cost.block_bytes)
    assert CostModel(load_model("smollm2-135m"), L4).kv_cache_groups == ()


def test_simulated_scheduler_uses_the_groups_and_runs_long_prompts():
    config = SimConfig(model=GEMMA, hardware=L4, policy="chunked", num_gpu_blocks=3000,
                       max_num_batched_tokens=1024)
    sched, *_ = build(config)
    assert sched.cache_config.kv_cache_groups == kv_cache_groups(GEMMA.attention_windows)
    n = 8
    workload = Workload(np.zeros(n), np.full(n, 3000), np.full(n, 16), np.zeros(n, np.int64),
                        "long prompts")
    result = simulate(config, workload)
    assert list(result.output_tokens) == [16] * n and result.num_gpu_blocks == 3000


def test_hybrid_runs_at_least_three_times_the_requests_of_one_uniform_group(capsys):
    hybrid, uniform = compare(GEMMA, 2**30, 8000, 128)
    assert hybrid.num_blocks // 6 == uniform.num_blocks  # same bytes (rounded down)
    assert (hybrid.max_concurrent, uniform.max_concurrent) == (32, 7)
    assert hybrid.max_concurrent >= 3 * uniform.max_concurrent
    assert main([]) == 0
    assert "hybrid / uniform: 4.57x" in capsys.readouterr().out
