"""Compare the simulator with nano-vllm's published benchmark (its README).

nano-vllm reports 1,434.13 output tok/s for Qwen3-0.6B on an RTX 4070 Laptop GPU: 256 requests,
prompt and output lengths uniform in [100, 1024], all submitted at once, ignore_eos
(133,966 output tokens in 93.41 s). Its bench.py draws the lengths with Python's ``random``
seeded with 0 (prompt length, then that many token ids, per request; then the 256 output
lengths); this script redraws them the same way, so the simulated workload has exactly the
published 133,966 output tokens, and simulates it with nano-vllm's engine settings
(max_num_seqs 512, max_num_batched_tokens 16384, 256-token blocks, max_model_len 4096,
90% of GPU memory, prefill-first scheduling, recompute preemption).

    .venv/bin/python benchmarks/sim_validate_nanovllm.py [--gpu rtx-4070-laptop]

It also prints what-if rows (other efficiencies / overheads) used in docs/simulation.md to
explain the gap. No torch needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys

import numpy as np

from conveyor.sim.cost_model import CostModel
from conveyor.sim.metrics import SLO
from conveyor.sim.runner import SimConfig, simulate
from conveyor.sim.specs import load_hardware, load_model
from conveyor.sim.workload import Workload

PUBLISHED_TOK_S = 1434.13
PUBLISHED_TOKENS = 133_966
PUBLISHED_TIME_S = 93.41


def nanovllm_bench_workload() -> Workload:
    rng = random.Random(0)
    prompt_lens = []
    for _ in range(256):
        length = rng.randint(100, 1024)
        prompt_lens.append(length)
        for _ in range(length):  # the prompt's token ids, drawn but not needed here
            rng.randint(0, 10000)
    output_lens = [rng.randint(100, 1024) for _ in range(256)]
    return Workload(np.zeros(256), np.array(prompt_lens, dtype=np.int64),
                    np.array(output_lens, dtype=np.int64), np.zeros(256, dtype=np.int64),
                    name="nano-vllm bench.py: 256 requests, uniform 100-1024 in/out, seed 0")


def run(model, hardware, workload) -> dict:
    config = SimConfig(model=model, hardware=hardware, max_num_seqs=512,
                       max_num_batched_tokens=16384, max_model_len=4096, block_size=256)
    result = simulate(config, workload, rate=math.inf)
    summary = result.summary(SLO())
    summary["num_gpu_blocks"] = result.num_gpu_blocks
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="rtx-4070-laptop")
    p.add_argument("--model", default="qwen3-0.6b")
    args = p.parse_args(argv)
    model, hardware = load_model(args.model), load_hardware(args.gpu)
    workload = nanovllm_bench_workload()
    assert int(workload.output_tokens.sum()) == PUBLISHED_TOKENS, "length draw differs from bench.py"
    cost = CostModel(model, hardware, block_size=256)
    print(f"workload: {workload.name}; {int(workload.prompt_tokens.sum()):,} prompt and "
          f"{int(workload.output_tokens.sum()):,} output tokens")
    print(f"{model.name} on {hardware.name}: KV cache {cost.num_gpu_blocks()} blocks x 256 = "
          f"{cost.num_gpu_blocks() * 256:,} tokens")
    base = run(model, hardware, workload)
    ratio = base["output_tok_s"] / PUBLISHED_TOK_S
    print(f"\npublished (nano-vllm README): {PUBLISHED_TOK_S:,.0f} out tok/s ({PUBLISHED_TIME_S} s)")
    print(f"simulated ({hardware.name}):   {base['output_tok_s']:,.0f} out tok/s "
          f"({base['makespan_s']:.1f} s), sim/published = {ratio:.2f}; "
          f"{base['preemptions']} preemptions, KV mean {base['kv_usage_mean']:.0%}")
    print("\nwhat-if (same workload and engine settings):")
    variants = {
        "memory_efficiency 0.7": dict(memory_efficiency=0.7),
        "step_overhead_ms 3": dict(step_overhead_ms=3.0),
        "peak 30 TFLOPS (lower laptop clocks)": dict(peak_matrix_tflops=30.0),
        "attention_efficiency 0.25": dict(attention_efficiency=0.25),
        "all four": dict(memory_efficiency=0.7, step_overhead_ms=3.0, peak_matrix_tflops=30.0,
                         attention_efficiency=0.25),
    }
    for name, change in variants.items():
        s = run(model, dataclasses.replace(hardware, **change), workload)
        print(f"  {name:38} {s['output_tok_s']:7,.0f} out tok/s  "
              f"(sim/published {s['output_tok_s'] / PUBLISHED_TOK_S:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
