"""Validate the simulator against the real engine: SmolLM2-135M on this CPU, same seeded workload.

Runs LLMEngine on a seeded Poisson workload in real time (requests are added when the wall clock
reaches their arrival), then ``conveyor.sim`` on the same workload with the ``this-cpu`` spec and
the engine's exact KV-cache size and limits, and prints measured vs simulated throughput and
median TTFT / TPOT with their ratios. Exit status 1 when a ratio is outside [0.75, 1.25].

    .venv/bin/python benchmarks/sim_validate_engine.py            # validate
    .venv/bin/python benchmarks/sim_validate_engine.py --fit      # calibrate this-cpu.yaml
    .venv/bin/python benchmarks/sim_validate_engine.py --refit    # both, back to back

``--fit`` instead runs an offline batch (a different seed and shape from the validation
workload), records every engine step's batch shape and wall time, and fits this-cpu's
overheads and efficiencies (peak rates come from benchmarks/sim_calibrate_cpu.py) by weighted
least squares on the roofline model; it prints the YAML fields to paste. Lives outside
``conveyor.sim`` because it imports the engine (and so torch).

``--threads`` (default 1) sets torch's intra-op threads. On a shared 2-core machine, torch's
default of 2 threads makes every op wait for a descheduled OpenMP thread: step times then swing
between 0.2 s and 5 s and say more about the neighbours than about the engine. One thread gives
stable step times; calibration and validation must use the same setting.

``--clock`` (default ``cpu``): the engine's scheduler and output processor are given a clock
that counts this process's CPU time, with the idle gaps between arrivals skipped instead of
slept. With one thread that is the time the engine's work takes on a core of its own; wall time
on a machine shared by several busy processes swings 2x within minutes. ``--clock wall`` uses
real time (on a quiet machine the two agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from conveyor.core.sampling_params import SamplingParams
from conveyor.sim.cost_model import CostModel
from conveyor.sim.executor import batch_shape
from conveyor.sim.metrics import SLO
from conveyor.sim.runner import SimConfig, simulate
from conveyor.sim.specs import GB, load_hardware, load_model
from conveyor.sim.workload import Workload, generate


class WallClock:
    """Real time; idle gaps are slept through."""

    def __call__(self) -> float:
        return time.monotonic()

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


class CpuClock:
    """This process's CPU time, plus the idle gaps between arrivals (skipped, not slept).

    With one torch thread it measures what the engine's work takes on a core of its own,
    whatever the neighbours do; wall time on the shared machine measures them too.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.process_time() + self.offset

    def idle_until(self, t: float) -> None:
        self.offset += max(0.0, t - self())


def use_clock(engine, clock) -> None:
    """Make the engine stamp request metrics with ``clock`` (its scheduler and output processor)."""
    engine._clock = clock
    engine.scheduler.clock = clock
    engine._outputs._clock = clock


def run_engine(engine, workload: Workload, seed: int, record_steps: bool = False):
    """Serve ``workload`` in real time; per-request (arrival, first token, finish, tokens), steps."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in workload.prompt_tokens]
    steps: list[tuple] = []
    shape_now: list = []
    if record_steps:
        execute = engine.executor.execute

        def recording_execute(so):
            shape_now.append(batch_shape(so)[0])
            return execute(so)

        engine.executor.execute = recording_execute
    n = len(workload)
    results: dict[int, tuple] = {}
    clock = engine._clock
    t0 = clock()
    i = 0
    while len(results) < n:
        now = clock() - t0
        while i < n and workload.arrival_s[i] <= now:
            params = SamplingParams(max_tokens=int(workload.output_tokens[i]), ignore_eos=True,
                                    temperature=0.0)
            engine.add_request(str(i), prompts[i], params, priority=int(workload.priority[i]),
                               arrival_time=t0 + float(workload.arrival_s[i]))
            i += 1
        if not engine.has_unfinished_requests():
            if i >= n:
                raise RuntimeError(f"engine finished {len(results)} of {n} requests")
            clock.idle_until(t0 + float(workload.arrival_s[i]))
            continue
        shape_now.clear()
        start = clock()
        outputs = engine.step()
        elapsed = clock() - start
        if shape_now:
            steps.append((*shape_now[0], elapsed))
        for out in outputs:
            if out.finished:
                m = out.metrics
                results[int(out.request_id)] = (m.arrival_time - t0, m.first_token_time - t0,
                                                m.finished_time - t0, len(out.outputs[0].token_ids))
    rows = np.array([results[k] for k in range(n)])
    return rows, np.array(steps)


def latency_figures(arrival, first, finish, tokens) -> dict:
    span = finish.max() - arrival.min()
    multi = tokens > 1
    return {
        "output tok/s": tokens.sum() / span,
        "median TTFT ms": float(np.median(first - arrival)) * 1e3,
        "median TPOT ms": float(np.median((finish - first)[multi] / (tokens[multi] - 1))) * 1e3,
    }


def make_engine(args):
    """A fresh engine (empty prefix cache), warmed up so first-call costs are not measured."""
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len,
                                  num_gpu_blocks=args.num_gpu_blocks, policy=args.policy, seed=0))
    use_clock(engine, CpuClock() if args.clock == "cpu" else WallClock())
    engine.add_request("warmup", [1] * 64, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def sim_config(args, engine, hardware) -> SimConfig:
    return SimConfig(model=load_model("smollm2-135m"), hardware=hardware, policy=args.policy,
                     max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=engine.max_model_len, block_size=engine.engine_args.block_size,
                     num_gpu_blocks=engine.num_gpu_blocks)


def validate(args, hardware=None) -> int:
    hardware = hardware or load_hardware(args.gpu)
    workload = generate(args.requests, args.rate, args.input_len, args.output_len, seed=args.seed)
    print(f"workload: {workload.name}")
    measured = []
    for _ in range(args.repeats):
        engine = make_engine(args)
        engine_rows, _ = run_engine(engine, workload, args.seed)
        measured.append(latency_figures(*engine_rows.T))
    config = sim_config(args, engine, hardware)
    result = simulate(config, workload, rate=args.rate)
    simulated = latency_figures(result.arrival_s, result.first_token_s, result.finished_s,
                                result.output_tokens.astype(float))
    print(f"engine ({args.clock} clock, {args.threads} thread(s)): {engine.num_gpu_blocks} KV blocks "
          f"x {engine.engine_args.block_size}, "
          f"policy {args.policy}, max_num_seqs {args.max_num_seqs}; sim: {hardware.name} spec, "
          f"{result.num_steps} steps")
    print(f"\n{'metric':16} {'engine (median of ' + str(args.repeats) + ')':>24} {'simulated':>10} "
          f"{'sim/engine':>10}")
    ok = True
    for key in simulated:
        real = float(np.median([m[key] for m in measured]))
        ratio = simulated[key] / real
        ok &= 0.75 <= ratio <= 1.25
        print(f"{key:16} {real:24.1f} {simulated[key]:10.1f} {ratio:10.2f}")
    summary = result.summary(SLO())
    print(f"\nsim p90/p99 TTFT {summary['ttft_p90_ms']:.0f}/{summary['ttft_p99_ms']:.0f} ms; "
          f"engine runs: " + "; ".join(f"{m['output tok/s']:.0f} tok/s" for m in measured))
    print("within 25%" if ok else "NOT within 25%")
    return 0 if ok else 1


def fit(args) -> dict:
    """Least squares of the cost model's compute + overhead terms on recorded engine steps."""
    hardware = load_hardware(args.gpu)
    workload = generate(args.requests, args.rate, "uniform:16-384", "uniform:8-96",
                        seed=args.seed + 1)
    if args.steps and Path(args.steps).exists():  # refit recorded steps without the engine
        steps = np.load(args.steps)
        print(f"calibration steps from {args.steps}")
    else:
        print(f"calibration workload: {workload.name}")
        _, steps = run_engine(make_engine(args), workload, args.seed + 1, record_steps=True)
        if args.steps:
            np.save(args.steps, steps)
    base = CostModel(load_model("smollm2-135m"),
                     dataclasses.replace(hardware, matmul_efficiency=1.0, attention_efficiency=1.0))
    tokens, seqs, samples, pairs, context = (steps[:, k] for k in range(5))
    t = steps[:, -1]
    peak = hardware.peak_matrix_tflops * 1e12
    linear_s = (tokens * base.linear_flops_per_token + samples * base.lm_head_flops_per_sample) / peak
    attention_s = pairs * base.attention_flops_per_pair / peak
    weight_bytes = np.array([base.weight_bytes(int(n)) for n in tokens])
    memory_s = (weight_bytes + (context + 2 * tokens) * base.kv_bytes_per_token) \
        / (hardware.memory_bandwidth_gbs * GB * hardware.memory_efficiency)
    # t = a + b*seqs + max(linear/me + attention/ae, memory), memory_efficiency kept from the
    # calibration script. Given which steps are compute-bound, this is linear in
    # (a, b, 1/me, 1/ae): solve, re-classify, repeat. Relative errors (rows divided by t);
    # a coefficient that comes out negative drops its column.
    x = np.array([0.0, 0.0, 1.0, 1.0])
    for _ in range(100):
        bound = linear_s * x[2] + attention_s * x[3] >= memory_s
        columns = np.stack([np.ones_like(t), seqs, linear_s * bound, attention_s * bound], axis=1)
        target = t - memory_s * ~bound
        keep = np.ones(4, dtype=bool)
        while True:
            new = np.zeros(4)
            new[keep], *_ = np.linalg.lstsq(columns[:, keep] / t[:, None], target / t, rcond=None)
            if (new >= 0).all():
                break
            keep &= new > 0
        new[2:] = np.maximum(new[2:], 1.0)  # efficiencies <= 1
        if np.allclose(new, x):
            break
        x = new
    a, b, inv_me, inv_ae = x
    compute = linear_s * inv_me + attention_s * inv_ae
    pred = a + b * seqs + np.maximum(compute, memory_s)
    err = np.abs(pred - t) / t
    print(f"{len(t)} engine steps, step time {t.min() * 1e3:.0f}-{t.max() * 1e3:.0f} ms; memory-bound "
          f"by the fit: {int((memory_s > compute).sum())}; |error| median {np.median(err):.1%}, "
          f"p90 {np.percentile(err, 90):.1%}")
    fitted = {"matmul_efficiency": round(1 / inv_me, 4), "attention_efficiency": round(1 / inv_ae, 4),
              "step_overhead_ms": round(a * 1e3, 2), "per_seq_overhead_us": round(b * 1e6, 1)}
    print(f"# this-cpu.yaml fields fitted from engine steps ({args.threads} torch thread(s))")
    for key, value in fitted.items():
        print(f"{key}: {value}")
    return fitted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="calibrate this-cpu from engine steps instead")
    p.add_argument("--refit", action="store_true",
                   help="calibrate, then validate with the fresh fit (one command, same conditions)")
    p.add_argument("--gpu", default="this-cpu", help="hardware spec for the simulator (default: this-cpu)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    p.add_argument("--input-len", default="uniform:32-256")
    p.add_argument("--output-len", default="uniform:16-64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="engine runs (the median is compared)")
    p.add_argument("--policy", default="prefill_first", choices=["prefill_first", "chunked"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    p.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                   help="engine time: process CPU time with idle gaps skipped (default; immune to "
                        "neighbours on a shared machine) or wall time")
    p.add_argument("--steps", help="--fit: save the recorded engine steps here (.npy), or refit "
                                   "them if the file exists")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.fit:
        fit(args)
        return 0
    if args.refit:
        fitted = fit(args)
        print()
        return validate(args, dataclasses.replace(load_hardware(args.gpu), **fitted))
    return validate(args)


if __name__ == "__main__":
    sys.exit(main())
