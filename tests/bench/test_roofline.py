"""Roofline arithmetic: model FLOPs/bytes for a workload and the ideal time on given rates."""

import argparse
import dataclasses

import pytest

from conveyor.bench import throughput
from conveyor.bench.report import Measurement, SystemResult
from conveyor.bench.roofline import DTYPE_BYTES, MachineRates, measure_machine, workload_roofline
from conveyor.bench.workloads import BenchRequest, Workload, make_workload
from conveyor.model.config import ModelConfig
from conveyor.model.shape import ModelShape

# SmolLM2-135M's shape
SMOL = ModelShape(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                  num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                  tie_word_embeddings=True)
BF16_WEIGHTS = 2 * 134_479_872  # bytes a forward reads: the layers' matmuls and the LM head
RATES = MachineRates(gemm_flops=830e9, mem_bandwidth=44e9, num_threads=2)


def test_parameter_counts_match_smollm2_135m():
    linear = SMOL.num_layers * SMOL.linear_params_per_layer
    assert linear == 106_168_320
    # + the (tied) embedding used as the LM head: SmolLM2's 134.5M parameters, minus norms
    assert linear + SMOL.lm_head_params == 134_479_872
    assert SMOL.matmul_params * 2 == BF16_WEIGHTS
    assert SMOL.kv_elements_per_token == 2 * 30 * 3 * 64


def test_a_model_config_is_a_shape_and_its_report_dict_gives_it_back():
    config = ModelConfig(name="smol", architecture="llama", dtype="bfloat16",
                         **SMOL.shape_dict())
    assert config.matmul_params == SMOL.matmul_params
    report = {"name": config.name, **config.shape_dict()}
    assert ModelShape.from_dict(report) == SMOL


def test_single_stream_decode_is_bandwidth_bound():
    roof = workload_roofline(SMOL, make_workload("S1", SMOL.vocab_size), RATES)
    # one token reads every weight once: 269 MB at 44 GB/s
    assert roof.single_stream_decode_tokens_per_s == pytest.approx(44e9 / BF16_WEIGHTS)
    assert roof.decode_s > 20 * roof.prefill_s
    weights_only = 255 * BF16_WEIGHTS / 44e9  # + a little KV cache read per step
    assert weights_only < roof.decode_s < 1.05 * weights_only


def test_w1_is_compute_bound_at_batch_64():
    w = make_workload("W1", SMOL.vocab_size)
    roof = workload_roofline(SMOL, w, RATES)
    assert roof.flops / RATES.gemm_flops == pytest.approx(roof.time_s, rel=0.01)
    assert 1000 < roof.output_tokens_per_s < 2000  # about 1,250 on a 2-core AVX-512 machine
    assert roof.output_tokens_per_s == pytest.approx(w.num_output_tokens / roof.time_s)


def test_prefix_caching_computes_the_shared_prefix_once():
    w = make_workload("W2", SMOL.vocab_size)
    cached = workload_roofline(SMOL, w, RATES, prefix_caching=True)
    uncached = workload_roofline(SMOL, w, RATES, prefix_caching=False)
    assert cached.prefill_s < uncached.prefill_s / 5
    assert cached.decode_s == uncached.decode_s


def test_batches_of_max_num_seqs_make_decode_longer():
    reqs = [BenchRequest([300] * 16, 32) for _ in range(8)]
    w = Workload("t", "", 0, reqs)
    wide = workload_roofline(SMOL, w, RATES, max_num_seqs=8)
    narrow = workload_roofline(SMOL, w, RATES, max_num_seqs=1)
    assert narrow.decode_s > 4 * wide.decode_s  # bandwidth bound: 8 waves instead of 1


def test_measure_machine_gives_positive_rates():
    rates = measure_machine("float32", gemm_size=128, bandwidth_mib=8, repeats=2)
    assert rates.gemm_flops > 0 and rates.mem_bandwidth > 0 and rates.num_threads >= 1


def test_small_steps_read_the_engine_quantized_weights():
    w = make_workload("S1", SMOL.vocab_size)
    dense = workload_roofline(SMOL, w, RATES)
    quarter = [BF16_WEIGHTS / 4] * 8  # steps of <= 8 tokens read a quarter of the bytes
    small = workload_roofline(SMOL, w, RATES, step_weight_bytes=quarter)
    assert small.single_stream_decode_tokens_per_s == pytest.approx(
        4 * dense.single_stream_decode_tokens_per_s)
    assert small.decode_s < dense.decode_s / 3
    assert small.prefill_s == dense.prefill_s  # a 128-token prefill reads the dense weights
    w1 = make_workload("W1", SMOL.vocab_size)  # batch 64: compute bound, no change
    assert workload_roofline(SMOL, w1, RATES, step_weight_bytes=quarter).decode_s == \
        pytest.approx(workload_roofline(SMOL, w1, RATES).decode_s, rel=0.01)


@pytest.mark.slow
def test_bench_roofline_counts_the_weights_the_engine_reads():
    """The real engine reports the weight bytes of each step size; the roofline uses them."""
    from conveyor.engine.args import EngineArgs

    ea = EngineArgs(kv_cache_memory=50_000_000, max_num_seqs=4)
    job = {"system": "conveyor", "workload": "S1", "seed": 0, "num_requests": None, "repeats": 1,
           "profile": False, "engine_args": dataclasses.asdict(ea)}
    result = throughput.run_conveyor(job)
    per_step = result.extra["step_weight_bytes"]
    shape = ModelShape.from_dict(result.extra["model_config"])
    dense = shape.matmul_params * DTYPE_BYTES[result.extra["dtype"]]
    assert len(per_step) == 4 and per_step == sorted(per_step)
    assert per_step[-1] <= dense + 1e6
    args = argparse.Namespace(workload="S1", seed=0, num_requests=None)
    summary = throughput.roofline_summary(args, result, RATES)
    assert summary["single_stream_decode_tokens_per_s"] == pytest.approx(
        1 / max(per_step[0] / RATES.mem_bandwidth,
                (shape.linear_flops_per_token + shape.lm_head_flops) / RATES.gemm_flops))


# ------------------------------------------------------------------ integer compute (int8)

INT8_RATES = dataclasses.replace(RATES, int8_ops=4 * RATES.gemm_flops)


def test_int8_bounds_the_linear_layers_by_the_int8_rate_and_attention_by_the_float_one():
    reqs = [BenchRequest([300] * 512, 1) for _ in range(16)]  # prefill only, compute bound
    w = Workload("t", "", 0, reqs)
    blocks = [BF16_WEIGHTS / 4] * 64
    floating = workload_roofline(SMOL, w, INT8_RATES, step_weight_bytes=blocks)
    integer = workload_roofline(SMOL, w, INT8_RATES, step_weight_bytes=blocks,
                                weight_compute="int8")
    attention = 16 * SMOL.attention_flops_per_pair * (512 * 513 // 2)
    assert floating.prefill_s == pytest.approx(floating.flops / RATES.gemm_flops)
    assert integer.prefill_s == pytest.approx(
        (floating.flops - attention) / INT8_RATES.int8_ops + attention / RATES.gemm_flops)
    assert floating.prefill_s / 4 < integer.prefill_s < floating.prefill_s / 3
    assert integer.flops == floating.flops


def test_int8_steps_read_the_blocks_at_every_batch_size_and_prefill():
    w = make_workload("S1", SMOL.vocab_size)  # one 128-token prefill step, then decode
    blocks = [BF16_WEIGHTS / 4] * 4  # fewer entries than the prefill step's tokens
    floating = workload_roofline(SMOL, w, INT8_RATES, step_weight_bytes=blocks)
    integer = workload_roofline(SMOL, w, INT8_RATES, step_weight_bytes=blocks,
                                weight_compute="int8")
    assert integer.bytes == pytest.approx(floating.bytes - BF16_WEIGHTS * 3 / 4)
    assert integer.prefill_s < floating.prefill_s
    assert integer.decode_s == pytest.approx(floating.decode_s)  # bandwidth bound at batch 1
    assert integer.single_stream_decode_tokens_per_s == pytest.approx(44e9 * 4 / BF16_WEIGHTS)


def test_int8_decode_steps_beyond_the_listed_sizes_read_the_blocks():
    reqs = [BenchRequest([300] * 16, 32) for _ in range(8)]  # batch 8: bandwidth bound
    w = Workload("t", "", 0, reqs)
    blocks = [BF16_WEIGHTS / 4] * 4
    floating = workload_roofline(SMOL, w, INT8_RATES, max_num_seqs=8, step_weight_bytes=blocks)
    integer = workload_roofline(SMOL, w, INT8_RATES, max_num_seqs=8, step_weight_bytes=blocks,
                                weight_compute="int8")
    # one prefill step and 31 decode steps, each reading a quarter of the dtype's bytes
    assert floating.bytes - integer.bytes == pytest.approx(32 * BF16_WEIGHTS * 3 / 4)
    assert integer.decode_s < floating.decode_s / 3


def test_float_mode_ignores_the_int8_rate():
    for name in ("S1", "W1"):
        w = make_workload(name, SMOL.vocab_size)
        assert workload_roofline(SMOL, w, INT8_RATES, weight_compute="float") == \
            workload_roofline(SMOL, w, RATES)


def test_int8_needs_its_rate_and_the_engine_step_bytes():
    w = make_workload("S1", SMOL.vocab_size)
    with pytest.raises(ValueError, match="int8_ops"):
        workload_roofline(SMOL, w, RATES, step_weight_bytes=[1.0], weight_compute="int8")
    with pytest.raises(ValueError, match="step_weight_bytes"):
        workload_roofline(SMOL, w, INT8_RATES, weight_compute="int8")


def test_measure_machine_measures_int8_only_when_asked():
    assert measure_machine("float32", gemm_size=64, bandwidth_mib=4, repeats=1).int8_ops is None
    rates = measure_machine("float32", gemm_size=128, bandwidth_mib=4, repeats=2, int8=True)
    assert rates.int8_ops is not None and rates.int8_ops > 0


def test_the_int8_rate_is_the_fastest_of_torch_and_conveyor_and_names_it(monkeypatch):
    """oneDNN's integer GEMM (torch._int_mm) falls back to slow code without VNNI, where
    Conveyor's own kernel is the integer path's rate, on 8-bit or on 4-bit codes; the fastest
    one is taken and named."""
    from conveyor.bench import roofline

    monkeypatch.setattr(roofline, "_int_mm_rate", lambda size, timed: 2e9)
    for quant in ("Q8_0", "Q4_0"):
        ours = roofline._int8_block_gemm_rate(128, lambda kernel: (kernel(), 1e-3)[1], quant)
        assert ours == 2.0 * 128**3 / 1e-3  # it ran the kernel once through `timed`
    monkeypatch.setattr(roofline, "_int8_block_gemm_rate",
                        lambda size, timed, quant: {"Q8_0": 150e9, "Q4_0": 170e9}[quant])
    rates = measure_machine("float32", gemm_size=64, bandwidth_mib=4, repeats=1, int8=True)
    assert (rates.int8_ops, rates.int8_source) == (170e9, "Conveyor's int8_block_gemm, Q4_0")
    monkeypatch.setattr(roofline, "_int_mm_rate", lambda size, timed: 900e9)
    rates = measure_machine("float32", gemm_size=64, bandwidth_mib=4, repeats=1, int8=True)
    assert (rates.int8_ops, rates.int8_source) == (900e9, "torch._int_mm")


def _run(weight_compute: str, step_weight_bytes: list[float]) -> SystemResult:
    ea = {"max_num_seqs": 4, "max_num_batched_tokens": 4096, "enable_prefix_caching": True}
    extra = {"engine_args": ea, "model_config": {"name": "smol", **SMOL.shape_dict()},
             "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
             "weight_compute": weight_compute, "step_weight_bytes": step_weight_bytes}
    return SystemResult("conveyor", "", [Measurement(1.0, 128, 256, 0.05, 100.0)], extra=extra)


def test_roofline_summary_draws_the_integer_roofline_for_an_int8_run():
    args = argparse.Namespace(workload="S1", seed=0, num_requests=None)
    blocks = [BF16_WEIGHTS / 4] * 4
    summary = throughput.roofline_summary(args, _run("int8", blocks), INT8_RATES)
    assert summary["weight_compute"] == "int8" and summary["machine"]["int8_ops"] == 4 * 830e9
    assert summary["single_stream_decode_tokens_per_s"] == pytest.approx(44e9 * 4 / BF16_WEIGHTS)
    # a float run, or an int8 one whose int8 rate was not measured: the float roofline
    assert throughput.roofline_summary(args, _run("float", blocks),
                                       INT8_RATES)["weight_compute"] == "float"
    assert throughput.roofline_summary(args, _run("int8", blocks),
                                       RATES)["weight_compute"] == "float"


@pytest.mark.parametrize("weight_compute", ["int8", "float"])
def test_run_all_measures_the_int8_rate_after_an_int8_conveyor_run(monkeypatch, weight_compute):
    from conveyor.bench import roofline

    asked = []

    def measure(dtype: str, device: str, int8: bool) -> MachineRates:
        asked.append(int8)
        return INT8_RATES if int8 else RATES

    monkeypatch.setattr(throughput, "run_worker",
                        lambda job, system, config: _run(weight_compute, [BF16_WEIGHTS / 4] * 4))
    monkeypatch.setattr(roofline, "measure_machine", measure)
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    payload = throughput.run_all(parser.parse_args(["throughput", "--workload", "S1",
                                                    "--repeats", "1"]))
    assert asked == [weight_compute == "int8"]
    assert payload["roofline"]["weight_compute"] == weight_compute


ROOFLINE = {"metric": "output tok/s", "flops": 6.49e12, "bytes": 65.0e9, "time_s": 39.47,
            "prefill_s": 12.17, "decode_s": 27.30, "output_tokens_per_s": 208.0,
            "conveyor_best": 379.0, "fraction_of_roofline": 379 / 208}


def test_format_roofline_names_the_int8_rate_under_integer_compute():
    machine = {"gemm_flops": 155e9, "mem_bandwidth": 30.1e9, "num_threads": 2,
               "dtype": "bfloat16", "device": "cpu", "int8_ops": 748e9}
    text = throughput.format_roofline({**ROOFLINE, "machine": machine, "weight_compute": "int8"})
    assert text.splitlines()[0] == (
        "roofline: int8 GEMM 748 GOP/s (torch._int_mm) for the linear layers, bfloat16 GEMM "
        "155 GFLOP/s for attention, memory read 30.1 GB/s (2 threads, measured in the run)")
    assert "the GGUF blocks under integer compute" in text.splitlines()[1]
    machine["int8_source"] = "Conveyor's int8_block_gemm, Q8_0"
    text = throughput.format_roofline({**ROOFLINE, "machine": machine, "weight_compute": "int8"})
    assert text.startswith("roofline: int8 GEMM 748 GOP/s (Conveyor's int8_block_gemm, Q8_0) for")


def test_format_roofline_of_an_older_file_is_the_float_line():
    machine = {"gemm_flops": 164e9, "mem_bandwidth": 25.4e9, "num_threads": 2,
               "dtype": "bfloat16", "device": "cpu"}  # no int8_ops, no weight_compute
    assert throughput.format_roofline({**ROOFLINE, "machine": machine}) == (
        "roofline: bfloat16 GEMM 164 GFLOP/s, memory read 25.4 GB/s (2 threads, measured in the "
        "run)\n"
        "  workload: 6.49 TFLOP, 65.0 GB moved (weights as the engine holds them, quantized "
        "copies at small batches); ideal time 39.47s (prefill 12.17s + decode 27.30s)\n"
        "  ideal output tok/s 208; conveyor best 379 = 182% of the roofline")
