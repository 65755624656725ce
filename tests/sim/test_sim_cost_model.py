"""Cost model: a step computed by hand, tensor parallelism, memory sizing, monotonic sanity."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.sim.cost_model import CostModel, causal_pairs
from conveyor.sim.specs import HardwareSpec, ModelSpec, load_hardware, load_model

# A toy model small enough to count by hand: per layer q 4x4, k/v 4x2 each, o 4x4, MLP 3x4x8
# -> 16 + 16 + 16 + 96 = 144 linear params; LM head 4x10 = 40; KV per token per layer: K and V
# of 1 head x 2 dims x 2 bytes = 8 bytes.
TOY = ModelSpec(name="toy", num_layers=2, hidden_size=4, intermediate_size=8, num_heads=2,
                num_kv_heads=1, head_dim=2, vocab_size=10, max_position_embeddings=64,
                tie_word_embeddings=True)
# 1000 FLOP/s peak, 100 B/s: numbers one can follow.
SLOW = HardwareSpec(name="slow", memory_gb=1.0, peak_matrix_tflops=1e-9,
                    memory_bandwidth_gbs=1e-7, matmul_efficiency=0.5, attention_efficiency=0.25,
                    memory_efficiency=0.8, step_overhead_ms=1000.0, per_seq_overhead_us=5e5,
                    interconnect_bandwidth_gbs=1e-9, interconnect_latency_us=1e6, max_tp=2)


def test_toy_model_counts():
    assert TOY.linear_params_per_layer == 144
    assert TOY.kv_bytes_per_token == 16  # 2 layers x 8 bytes
    assert causal_pairs(2, 3) == 12  # queries at positions 2,3,4 see 3,4,5 keys
    assert causal_pairs(5, 1) == 6


def test_low_bit_weights_for_small_steps():
    # 2 layers x 144 params at 0.5 B/param + LM head 40 x 2 B = 144 + 80 bytes, for 1-4 tokens
    hw = dataclasses.replace(SLOW, low_bit_max_tokens=4, low_bit_weight_bytes=0.5)
    cost, plain = CostModel(TOY, hw), CostModel(TOY, SLOW)
    assert plain.weight_bytes(1) == plain.weight_bytes_per_step == (288 + 40) * 2
    assert cost.weight_bytes(1) == cost.weight_bytes(4) == 144 + 80
    assert cost.weight_bytes(5) == plain.weight_bytes_per_step
    args = dict(num_seqs=1, num_samples=1, attention_pairs=10, context_tokens=9)
    assert cost.breakdown(num_tokens=1, **args).bytes == 144 + 80 + (9 + 2) * 16  # + KV traffic
    assert cost.step_time(num_tokens=1, **args) == cost.breakdown(num_tokens=1, **args).total_s
    assert cost.step_time(num_tokens=1, **args) < plain.step_time(num_tokens=1, **args)


def test_hand_computed_step():
    # One prefill chunk (2 cached, 3 new, samples) and one decode (5 cached, 1 new):
    # T=4 tokens, B=2 seqs, S=2 samples, 18 attention pairs, 7 cached context tokens.
    cost = CostModel(TOY, SLOW)
    b = cost.breakdown(num_tokens=4, num_seqs=2, num_samples=2, attention_pairs=18,
                       context_tokens=7)
    # linear: 4 tok x 2 x 2 layers x 144 = 2304, LM head 2 x 2 x 40 = 160 -> 2464 at 500 FLOP/s
    # attention: 18 pairs x 4 x 2 layers x 2 heads x 2 dims = 576 at 250 FLOP/s
    assert b.flops == 2464 + 576
    assert b.compute_s == pytest.approx(2464 / 500 + 576 / 250)  # 7.232 s
    # bytes: weights (2 x 144 + 40) x 2 B = 656; KV read 7 + 4, written 4 -> 15 x 16 B = 240
    assert b.bytes == 896
    assert b.memory_s == pytest.approx(896 / 80)  # 11.2 s at 100 B/s x 0.8
    assert b.bound == "memory"
    assert b.overhead_s == pytest.approx(1.0 + 2 * 0.5)
    assert b.total_s == pytest.approx(13.2)
    assert cost.step_time(4, 2, 2, 18, 7) == pytest.approx(13.2)


def test_tensor_parallel_halves_work_and_adds_all_reduce():
    one, two = CostModel(TOY, SLOW, tp=1), CostModel(TOY, SLOW, tp=2)
    b1 = one.breakdown(4, 2, 2, 18, 7)
    b2 = two.breakdown(4, 2, 2, 18, 7)
    assert b2.compute_s == pytest.approx(b1.compute_s / 2)
    # weights split in two (328 B); one KV head cannot be split, so KV bytes stay 240
    assert b2.bytes == pytest.approx(656 / 2 + 240)
    # 2 all-reduces x 2 layers, each: 1 s latency + ring 2*(2-1)/2 x 4 tokens x 4 hidden x 2 B
    # over 1 B/s = 32 s
    assert b2.comm_s == pytest.approx(4 * (1.0 + 32.0))
    assert b1.comm_s == 0


def test_swap_and_copy_costs():
    cost = CostModel(TOY, SLOW, block_size=4)
    base = cost.step_time(1, 1, 1, 6, 5)
    # a block is 4 tokens x 16 B = 64 B; host link 16 GB/s by default
    assert cost.step_time(1, 1, 1, 6, 5, num_swapped_blocks=2) == pytest.approx(base + 128 / 16e9)
    # a device copy reads and writes the block: 128 more bytes at 80 B/s
    assert cost.step_time(1, 1, 1, 6, 5, num_copied_blocks=1) == pytest.approx(base + 128 / 80)


def test_kv_blocks_from_memory_minus_weights():
    model, gpu = load_model("llama-3-8b"), load_hardware("h100-sxm")
    cost = CostModel(model, gpu, block_size=16)
    usable = 85.5e9 * 0.9 - 2e9 - model.num_params * 2
    assert cost.num_gpu_blocks() == int(usable // (131072 * 16))
    assert 20_000 < cost.num_gpu_blocks() < 30_000  # ~420k tokens of KV


def test_model_that_does_not_fit_says_so():
    with pytest.raises(ValueError, match="does not fit on 1 x h100-sxm.*--tp"):
        CostModel(load_model("llama-3-70b"), load_hardware("h100-sxm")).num_gpu_blocks()
    assert CostModel(load_model("llama-3-70b"), load_hardware("h100-sxm"), tp=4).num_gpu_blocks() > 0


@pytest.mark.parametrize("tp, match", [(0, "tp must be"), (16, "max_tp"), (3, "num_heads")])
def test_bad_tp(tp, match):
    with pytest.raises(ValueError, match=match):
        CostModel(load_model("llama-3-8b"), load_hardware("h100-sxm"), tp=tp)


def test_tp_needs_an_interconnect():
    with pytest.raises(ValueError, match="interconnect"):
        CostModel(load_model("qwen3-0.6b"), dataclasses.replace(load_hardware("h100-sxm"),
                                                                 interconnect_bandwidth_gbs=0.0), tp=2)


batches = st.tuples(st.integers(1, 4096), st.integers(1, 256), st.integers(0, 256),
                    st.integers(0, 10**8), st.integers(0, 10**6))


@settings(max_examples=200, deadline=None)
@given(batch=batches, factor=st.floats(1.0, 100.0), tp=st.sampled_from([1, 2, 4, 8]))
def test_more_bandwidth_never_slows_a_step(batch, factor, tp):
    gpu = load_hardware("h100-sxm")
    faster = dataclasses.replace(gpu, memory_bandwidth_gbs=gpu.memory_bandwidth_gbs * factor)
    model = load_model("llama-3-8b")
    assert CostModel(model, faster, tp).step_time(*batch) <= CostModel(model, gpu, tp).step_time(*batch)


@settings(max_examples=200, deadline=None)
@given(batch=batches, extra=st.tuples(st.integers(0, 4096), st.integers(0, 10**6),
                                      st.integers(0, 10**6)))
def test_more_work_never_speeds_a_step_up(batch, extra):
    cost = CostModel(load_model("qwen3-8b"), load_hardware("a100-80g"))
    tokens, seqs, samples, pairs, context = batch
    more = (tokens + extra[0], seqs, samples, pairs + extra[1], context + extra[2])
    assert cost.step_time(*more) >= cost.step_time(*batch)


@settings(max_examples=100, deadline=None)
@given(batch=batches, factor=st.floats(1.0, 100.0))
def test_more_flops_never_speed_a_step_up(batch, factor):
    gpu = load_hardware("l4")
    slower = dataclasses.replace(gpu, peak_matrix_tflops=gpu.peak_matrix_tflops / factor)
    model = load_model("llama-3-8b")
    assert CostModel(model, slower).step_time(*batch) >= CostModel(model, gpu).step_time(*batch)


def test_decode_is_memory_bound_and_big_prefill_compute_bound_on_h100():
    cost = CostModel(load_model("llama-3-8b"), load_hardware("h100-sxm"))
    decode = cost.breakdown(32, 32, 32, 32 * 1000, 32 * 999)
    prefill = cost.breakdown(4096, 4, 4, 4 * causal_pairs(0, 1024), 0)
    assert decode.bound == "memory" and prefill.bound == "compute"
    # a 32-way decode step reads ~16 GB of weights: ~5.6 ms at 3.35 TB/s x 0.85
    assert 5e-3 < decode.total_s < 10e-3
