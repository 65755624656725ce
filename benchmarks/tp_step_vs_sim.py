"""Tensor parallelism on this CPU against the simulator: the all-reduce's cost, then engine
step times at TP=1 and TP=N next to the ``this-cpu`` cost model's prediction for each step.

1. ``N`` gloo ranks on loopback all-reduce ``[rows, hidden]`` activations (the model's dtype)
   for several row counts; a least-squares line through the fastest of each gives the fixed cost per
   all-reduce and the ring bandwidth, as the cost model prices them
   (``latency + 2 (N-1)/N bytes / bandwidth``): this-cpu.yaml's ``interconnect_latency_us``
   and ``interconnect_bandwidth_gbs``.
2. SmolLM2-135M serves a fixed offline batch at TP=1 and TP=N, one torch thread per rank, every
   step's batch shape and wall time recorded; each step is priced by ``CostModel`` with those
   all-reduce figures. Prints the median measured and predicted step time for prefill and
   decode steps.

    .venv/bin/python benchmarks/tp_step_vs_sim.py --tp 3

Wall time, not CPU time: the ranks are separate processes. On a shared machine the figures
carry its load; the script prints the load average it started with.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import torch

HIDDEN = 576  # SmolLM2-135M
ROWS = (1, 8, 64, 256)


def _allreduce_rank(rank: int, size: int, port: int, dtype_name: str, iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    dtype = getattr(torch, dtype_name)
    medians = []
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN).to(dtype)
        times = []
        for i in range(iters + 10):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if i >= 10:
                times.append(time.perf_counter() - start)
        # The fastest: on a shared machine the median mostly measures the neighbours.
        medians.append(min(times))
    if rank == 0:
        out.put(medians)
    dist.destroy_process_group()


def measure_allreduce(size: int, dtype: torch.dtype, iters: int) -> tuple[float, float, list]:
    """(latency s, bandwidth bytes/s, [(rows, median s)]) of one all-reduce over ``size`` ranks."""
    import torch.multiprocessing as mp

    from conveyor.distributed.group import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    name = str(dtype).removeprefix("torch.")
    procs = [ctx.Process(target=_allreduce_rank, args=(r, size, port, name, iters, out))
             for r in range(size)]
    for p in procs:
        p.start()
    medians = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    elem = torch.empty((), dtype=dtype).element_size()
    ring_bytes = np.array([2 * (size - 1) / size * r * HIDDEN * elem for r in ROWS])
    slope, intercept = np.polyfit(ring_bytes, np.array(medians), 1)
    return max(intercept, 0.0), 1.0 / max(slope, 1e-15), list(zip(ROWS, medians, strict=True))


def run_engine_steps(tp: int, dtype: str, requests: int, prompt: int, output: int):
    """[(shape, wall s)] of every step of one offline batch (after a warm-up request)."""
    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.executor.simulated import batch_shape

    engine = LLMEngine(EngineArgs(dtype=dtype, tensor_parallel_size=tp, threads_per_rank=1,
                                  num_gpu_blocks=256, max_num_seqs=64))
    params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0)
    engine.add_request("warmup", [1] * 64, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    rng = np.random.default_rng(0)
    for i in range(requests):
        engine.add_request(str(i), rng.integers(10, 40000, size=prompt).tolist(), params)
    shapes: list = []
    execute = engine.executor.execute

    def recording(so):
        shapes.append(batch_shape(so)[0])
        return execute(so)

    engine.executor.execute = recording
    steps = []
    while engine.has_unfinished_requests():
        shapes.clear()
        start = time.perf_counter()
        engine.step()
        if shapes:
            steps.append((shapes[0], time.perf_counter() - start))
    dtype_used = engine.executor.dtype
    engine.shutdown()
    return steps, dtype_used


def main() -> int:
    from conveyor.model.device import resolve_dtype
    from conveyor.sim.cost_model import CostModel
    from conveyor.sim.specs import GB, load_hardware, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--allreduce-only", action="store_true", help="skip the engine runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    runs = {} if args.allreduce_only else {
        tp: run_engine_steps(tp, args.dtype, args.requests, args.prompt_tokens,
                             args.output_tokens) for tp in (1, args.tp)}
    dtype = runs[1][1] if runs else resolve_dtype(args.dtype, torch.device("cpu"))
    latency, bandwidth, points = measure_allreduce(args.tp, dtype, args.iters)
    print(f"all-reduce over {args.tp} gloo ranks on loopback, [rows, {HIDDEN}] {dtype}:")
    for rows, t in points:
        print(f"  {rows:4d} rows: {t * 1e6:8.1f} us")
    print(f"fit: interconnect_latency_us: {latency * 1e6:.0f}  "
          f"interconnect_bandwidth_gbs: {bandwidth / GB:.2f}")
    hw = dataclasses.replace(load_hardware("this-cpu"), max_tp=max(args.tp, 1),
                             interconnect_latency_us=latency * 1e6,
                             interconnect_bandwidth_gbs=bandwidth / GB)
    model = load_model("smollm2-135m")
    print("| TP | steps | prefill median ms measured / simulated | decode median ms measured / "
          "simulated | total s measured / simulated |")
    print("|---|---|---|---|---|")
    for tp, (steps, _) in runs.items():
        cost = CostModel(model, hw, tp=tp)
        rows = {"prefill": [], "decode": []}
        for shape, wall in steps:
            kind = "decode" if shape[0] == shape[1] else "prefill"
            rows[kind].append((wall, cost.step_time(*shape)))
        cells = []
        for kind in ("prefill", "decode"):
            pairs = rows[kind]
            if pairs:
                cells.append(f"{1e3 * statistics.median(p[0] for p in pairs):.1f} / "
                             f"{1e3 * statistics.median(p[1] for p in pairs):.1f}")
            else:
                cells.append("-")
        measured = sum(w for _, w in steps)
        simulated = sum(cost.step_time(*s) for s, _ in steps)
        print(f"| {tp} | {len(steps)} | {cells[0]} | {cells[1]} | {measured:.2f} / "
              f"{simulated:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
