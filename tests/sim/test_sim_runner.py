"""The real Scheduler driven by the SimulatedExecutor on a virtual clock."""

import dataclasses
import math

import numpy as np
import pytest

from conveyor.core.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.sim.clock import VirtualClock
from conveyor.sim.cost_model import CostModel
from conveyor.sim.executor import SimulatedExecutor, batch_shape
from conveyor.sim.metrics import SLO
from conveyor.sim.runner import SimConfig, simulate
from conveyor.sim.specs import load_hardware, load_model
from conveyor.sim.workload import Workload, generate

H100, L4 = load_hardware("h100-sxm"), load_hardware("l4")
LLAMA, QWEN = load_model("llama-3-8b"), load_model("qwen3-0.6b")


def test_clock_only_moves_forward():
    clock = VirtualClock()
    clock.advance(1.5)
    clock.advance_to(1.0)
    assert clock() == 1.5
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)


def test_executor_prices_the_step_the_scheduler_asked_for():
    cost = CostModel(LLAMA, H100)
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks=64), clock=clock)
    executor = SimulatedExecutor(cost, clock, token_id=7)
    for rid, n in (("a", 5), ("b", 3)):
        sched.add_request(rid, [hash(rid) % 1000 + 1] * n,
                          SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0)
    out = sched.schedule()
    # prefill of 5 and 3 tokens: 8 tokens, 2 samples, 15 + 6 causal pairs, nothing cached
    assert batch_shape(out)[0] == (8, 2, 2, 21, 0, 0, 0)
    sampled = executor.execute(out).sampled_token_ids
    assert sampled == [[7], [7]]
    assert clock() == pytest.approx(cost.step_time(8, 2, 2, 21, 0))
    sched.update(out, sampled)
    t_prefill = clock()
    out = sched.schedule()
    # decode: 1 token each after 5 and 3 cached -> pairs 6 + 4, context 8
    assert batch_shape(out)[0] == (2, 2, 2, 10, 8, 0, 0)
    sched.update(out, executor.execute(out).sampled_token_ids)
    assert clock() == pytest.approx(t_prefill + cost.step_time(2, 2, 2, 10, 8))
    assert executor.num_steps == 2


def test_a_lone_request_sees_exactly_the_cost_model():
    cost = CostModel(LLAMA, H100)
    w = Workload(np.array([0.25]), np.array([100]), np.array([4]), np.array([0]))
    r = simulate(SimConfig(LLAMA, H100), w)
    prefill = cost.step_time(100, 1, 1, 100 * 101 // 2, 0)
    decodes = sum(cost.step_time(1, 1, 1, c + 1, c) for c in (100, 101, 102))
    assert r.ttft_s[0] == pytest.approx(prefill)
    assert r.e2e_s[0] == pytest.approx(prefill + decodes)
    assert r.tpot_s[0] == pytest.approx(decodes / 3)
    assert r.output_tokens.tolist() == [4] and r.finish_reason == ["length"]


def test_same_seed_same_result():
    w = generate(300, 30.0, seed=5)
    a = simulate(SimConfig(QWEN, L4, policy="chunked"), w)
    b = simulate(SimConfig(QWEN, L4, policy="chunked"), generate(300, 30.0, seed=5))
    assert np.array_equal(a.first_token_s, b.first_token_s)
    assert np.array_equal(a.finished_s, b.finished_s)
    assert a.num_steps == b.num_steps


def test_every_request_finishes_with_its_output_length_even_under_preemption():
    w = generate(200, math.inf, "uniform:50-400", "uniform:10-200", seed=1)
    for mode in ("recompute", "swap"):
        r = simulate(SimConfig(QWEN, L4, num_gpu_blocks=300, max_num_seqs=64,
                               preemption_mode=mode, swap_space_gb=0.05), w)
        assert r.num_preemptions > 0
        assert np.array_equal(r.output_tokens, w.output_tokens)
        assert set(r.finish_reason) == {"length"}
        assert np.all(r.first_token_s >= r.arrival_s) and np.all(r.finished_s >= r.first_token_s)


def test_too_long_prompt_is_ignored_not_hung():
    w = Workload(np.array([0.0, 0.1]), np.array([5000, 10]), np.array([5, 5]), np.array([0, 0]))
    r = simulate(SimConfig(QWEN, L4, max_model_len=1024), w)
    assert r.finish_reason == ["ignored", "length"]
    assert r.summary(SLO())["ignored"] == 1


def test_priority_queue_serves_high_priority_first_under_load():
    w = generate(400, 200.0, "uniform:200-800", "uniform:50-150", priorities="0,1", seed=2)
    r = simulate(SimConfig(QWEN, L4, queue="priority", max_num_seqs=32), w)
    ttft = r.ttft_s
    assert np.median(ttft[r.priority == 0]) < np.median(ttft[r.priority == 1])


def test_chunked_prefill_smooths_decodes_behind_long_prompts():
    w = generate(120, 4.0, "uniform:3000-6000", "uniform:100-300", seed=3)
    first = simulate(SimConfig(LLAMA, L4, policy="prefill_first"), w).summary(SLO())
    chunked = simulate(SimConfig(LLAMA, L4, policy="chunked", max_num_batched_tokens=512), w).summary(SLO())
    assert chunked["tpot_p99_ms"] < first["tpot_p99_ms"]


def test_faster_memory_finishes_a_decode_heavy_batch_sooner():
    w = generate(100, math.inf, "fixed:64", "fixed:256", seed=0)
    slow = simulate(SimConfig(LLAMA, H100), w).makespan_s
    fast = simulate(SimConfig(LLAMA, dataclasses.replace(H100, memory_bandwidth_gbs=2 * 3350.0)), w).makespan_s
    assert fast < slow


def test_summary_fields():
    r = simulate(SimConfig(QWEN, L4), generate(100, 10.0, seed=0))
    s = r.summary(SLO(ttft_s=10.0, tpot_s=1.0))
    assert s["served"] == 100 and s["slo_attainment"] == 1.0
    assert s["goodput_req_s"] == pytest.approx(s["throughput_req_s"])
    assert s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"]
    assert 0 < s["kv_usage_mean"] <= s["kv_usage_peak"] <= 1
    assert s["output_tok_s"] == pytest.approx(r.output_tokens.sum() / r.makespan_s)
    strict = r.summary(SLO(ttft_s=1e-6, tpot_s=1e-6))
    assert strict["goodput_req_s"] == 0


@pytest.mark.parametrize("field, value, match", [
    ("policy", "fastest", "policy must be one of"), ("queue", "lifo", "queue must be one of"),
    ("max_num_seqs", 0, "max_num_seqs must be"), ("num_gpu_blocks", -3, "num_gpu_blocks must be"),
])
def test_bad_sim_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        SimConfig(QWEN, L4, **{field: value})


def test_sim_config_choices_given_as_strings_become_enum_members():
    config = SimConfig(QWEN, L4, policy="chunked", preemption_mode="swap")
    assert config.policy is SchedulingPolicy.CHUNKED
    assert config.preemption_mode is PreemptionMode.SWAP
    assert config.label == "chunked/fcfs/swap"
    described = config.describe()
    assert described["policy"] == "chunked" and str(described["queue"]) == "fcfs"
    with pytest.raises(ValueError, match="preemption_mode must be one of 'recompute', 'swap'"):
        SimConfig(QWEN, L4, preemption_mode="kill")


def test_parallel_samples_and_prompt_chunks_get_the_right_number_of_tokens():
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128,
                                      policy="chunked"),
                      CacheConfig(block_size=4, num_gpu_blocks=64), clock=clock)
    executor = SimulatedExecutor(CostModel(QWEN, L4), clock)
    sched.add_request("n3", [5] * 40, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    finished, chunks = [], 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = executor.execute(out).sampled_token_ids
        chunks += sum(1 for s in sampled if not s)
        finished += sched.update(out, sampled)
    (group,) = finished
    assert chunks == 2  # a 40-token prompt in 16-token chunks: two chunks sample nothing
    assert [s.num_output_tokens for s in group.seqs] == [4, 4, 4]
    assert group.metrics.first_token_time > 0
