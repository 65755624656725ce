"""`conveyor bench scheduler`: the scheduler's own cost, with a fake executor.

Workload (seeded, named ``sched-1024``): 1024 requests, prompt lengths uniform in [100, 1024]
with token ids uniform in [0, 10000), max_tokens uniform in [100, 1024], ignore_eos; all queued
before the clock starts. Limits: block_size 256, max_num_seqs 512, max_num_batched_tokens 16384;
num_gpu_blocks 2000 (forces preemption) and 10000. Only ``schedule()`` + ``update()`` are timed
(wall clock, or ``--timer cpu`` for this thread's CPU time on a busy machine); the fake executor
(untimed) samples one token per requested sample. Prints, per policy and block count, steps,
preemptions, and the min and median over ``--runs`` of µs per step and µs per generated token.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass

from conveyor.bench.report import write_result
from conveyor.core.config import SchedulingPolicy


@dataclass
class RunResult:
    policy: str
    num_gpu_blocks: int
    steps: int
    preemptions: int
    generated_tokens: int
    seconds: float

    @property
    def us_per_step(self) -> float:
        return self.seconds / self.steps * 1e6

    @property
    def us_per_token(self) -> float:
        return self.seconds / self.generated_tokens * 1e6


def make_workload(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt = [rng.randrange(10000) for _ in range(rng.randint(100, 1024))]
        out.append((prompt, rng.randint(100, 1024)))
    return out


def run_once(policy: str, num_gpu_blocks: int, workload: list[tuple[list[int], int]],
             timer=time.perf_counter,
             prefix_caching: bool = True) -> RunResult:
    from conveyor.core.config import CacheConfig, SchedulerConfig
    from conveyor.core.sampling_params import SamplingParams
    from conveyor.core.scheduler import Scheduler

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=16384, max_model_len=4096,
                        policy=policy),
        CacheConfig(block_size=256, num_gpu_blocks=num_gpu_blocks,
                    enable_prefix_caching=prefix_caching))
    for i, (prompt, max_tokens) in enumerate(workload):
        sched.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    one = [1]
    schedule, update = sched.schedule, sched.update
    perf = timer
    elapsed = 0.0
    steps = generated = 0
    gc.collect()
    while sched.has_unfinished_requests():
        t0 = perf()
        out = schedule()
        t1 = perf()
        n = len(out.seqs)
        if out.num_decodes == n:
            sampled = [one] * n
        else:
            sampled = [one * out.num_samples(i) if i >= out.num_decodes else one
                       for i in range(n)]
        generated += sum(map(len, sampled))
        t2 = perf()
        update(out, sampled)
        elapsed += t1 - t0 + perf() - t2
        steps += 1
    return RunResult(policy, num_gpu_blocks, steps, sched.num_preemptions, generated, elapsed)


def _row(results: list[RunResult]) -> dict:
    per_token = sorted(r.us_per_token for r in results)
    per_step = sorted(r.us_per_step for r in results)
    first = results[0]
    return {
        "policy": first.policy,
        "num_gpu_blocks": first.num_gpu_blocks,
        "steps": first.steps,
        "preemptions": first.preemptions,
        "generated_tokens": first.generated_tokens,
        "us_per_step_min": per_step[0],
        "us_per_step_median": statistics.median(per_step),
        "us_per_token_min": per_token[0],
        "us_per_token_median": statistics.median(per_token),
        "runs": [asdict(r) for r in results],
    }


def main(args: argparse.Namespace) -> int:
    workload = make_workload(args.num_requests, args.seed)
    rows = []
    print(f"{'policy':<14}{'blocks':>7}{'steps':>8}{'preempt':>9}{'tokens':>9}"
          f"{'us/step min':>13}{'median':>9}{'us/token min':>14}{'median':>9}")
    for blocks in args.num_gpu_blocks:
        for policy in args.policies:
            timer = time.thread_time if args.timer == "cpu" else time.perf_counter
            results = [run_once(policy, blocks, workload, timer=timer,
                                prefix_caching=not args.no_prefix_caching)
                       for _ in range(args.runs)]
            row = _row(results)
            rows.append(row)
            print(f"{policy:<14}{blocks:>7}{row['steps']:>8}{row['preemptions']:>9}"
                  f"{row['generated_tokens']:>9}{row['us_per_step_min']:>13.1f}"
                  f"{row['us_per_step_median']:>9.1f}{row['us_per_token_min']:>14.3f}"
                  f"{row['us_per_token_median']:>9.3f}", flush=True)
    if args.json:
        write_result(args.json, {"workload": {"name": "sched-1024",
                                              "num_requests": args.num_requests,
                                              "seed": args.seed, "block_size": 256,
                                              "max_num_seqs": 512, "max_num_batched_tokens": 16384,
                                              "prefix_caching": not args.no_prefix_caching,
                                              "timer": args.timer},
                                 "results": rows})
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scheduler", help="time schedule()+update() with a fake executor",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=SchedulingPolicy.values(),
                   choices=SchedulingPolicy.values())
    p.add_argument("--num-gpu-blocks", nargs="+", type=int, default=[2000, 10000])
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3, help="repeats; min and median are reported")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--timer", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter; cpu: this thread's CPU time (steadier on a busy machine)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=main)
