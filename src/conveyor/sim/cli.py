"""`conveyor simulate`: run the real scheduler against a GPU cost model, compare policies and rates.

One run per (rate, policy, queue); every policy at a rate sees the same seeded workload.
Prints a table (throughput, TTFT/TPOT/E2E p50/p90/p99, preemptions, KV usage, goodput under
the SLO) and optionally writes ``--json``, ``--plot DIR`` PNGs and a ``--report`` markdown file.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from conveyor.core.config import PreemptionMode, QueueOrder, SchedulingPolicy
from conveyor.sim.pd_cli import add_arguments as add_pd_arguments


def _csv(kind):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        try:
            return [kind(t) for t in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None
    return parse


def _rate(text: str) -> float:
    rate = float(text)
    if not (rate > 0):
        raise ValueError(f"rates must be > 0 requests/s (or inf), got {text}")
    return rate


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate the scheduler on a GPU cost model (no model, no GPU needed)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="model spec name or YAML path (default: llama-3-8b)")
    p.add_argument("--gpu", default="h100-sxm", help="hardware spec name or YAML path (default: h100-sxm)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default: 1)")
    p.add_argument("--list-specs", action="store_true", help="list built-in model and hardware specs")
    w = p.add_argument_group("workload")
    w.add_argument("--rate", type=_csv(_rate), default=None,
                   help="request rates, req/s, comma-separated; inf = all at t=0 (default: 10)")
    w.add_argument("--requests", type=int, default=1000, help="requests per run (default: 1000)")
    w.add_argument("--input-len", default="chat-input",
                   help="prompt lengths: fixed:N | uniform:A-B | lognormal:mean=M,sigma=S | chat-input")
    w.add_argument("--output-len", default="chat-output",
                   help="output lengths: same forms, or chat-output")
    w.add_argument("--arrival", default="poisson", help="poisson or gamma:CV (default: poisson)")
    w.add_argument("--priorities", default="0", help="priority values, e.g. 0,1,2 or 0:0.2,1:0.8")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    w.add_argument("--trace", help="JSONL trace (arrival_s, prompt_tokens, output_tokens, priority) "
                                   "instead of a generated workload")
    w.add_argument("--save-trace", help="write the generated workload (first rate) as a JSONL trace")
    e = p.add_argument_group("engine")
    e.add_argument("--policy", type=_csv(str), default=[SchedulingPolicy.PREFILL_FIRST],
                   help=f"policies, comma-separated: {','.join(SchedulingPolicy.values())}")
    e.add_argument("--queue", type=_csv(str), default=[QueueOrder.FCFS],
                   help=f"queue orders, comma-separated: {','.join(QueueOrder.values())}")
    e.add_argument("--preemption-mode", default=PreemptionMode.RECOMPUTE,
                   choices=PreemptionMode.values())
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default 8192 (and >= max-model-len under prefill_first)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's context length, capped at 8192")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks (default: derived from memory minus weights)")
    e.add_argument("--swap-space", type=float, default=4.0, help="GB of CPU swap per GPU (swap mode)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="as the engine (default: on). Simulated prompts are distinct, so it only "
                        "hits when a preempted sequence is recomputed; off halves the run time")
    e.add_argument("--long-prefill-token-threshold", type=int, default=0)
    e.add_argument("--max-num-partial-prefills", type=int, default=1)
    f = p.add_argument_group("fleet (data-parallel replicas behind a router)")
    f.add_argument("--replicas", type=int, default=None,
                   help="replicas of the engine, each its own scheduler and GPU(s) (default: 1; "
                        "with --pd: P+D, the colocated system compared; 0: none)")
    f.add_argument("--router", type=_csv(str), default=["prefix_affinity"],
                   help="routers, comma-separated: prefix_affinity,round_robin,least_loaded,"
                   "kv_aware")
    f.add_argument("--shared-prefix", default=None, metavar="G:L",
                   help="prompts start with one of G shared L-token prefixes (default: all "
                        "prompts distinct)")
    add_pd_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--slo", default="ttft=1s,tpot=50ms", help="goodput SLO (default: ttft=1s,tpot=50ms)")
    o.add_argument("--json", help="write every run's summary to this JSON file")
    o.add_argument("--plot", help="write PNG plots into this directory")
    o.add_argument("--report", help="write a markdown report to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as e:
        print(f"conveyor simulate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from conveyor.sim import report
    from conveyor.sim.cost_model import CostModel
    from conveyor.sim.metrics import SLO
    from conveyor.sim.runner import SimConfig, simulate
    from conveyor.sim.specs import list_specs, load_hardware, load_model
    from conveyor.sim.workload import generate, load_trace

    if args.list_specs:
        print("models:  ", ", ".join(list_specs("models")))
        print("hardware:", ", ".join(list_specs("hardware")))
        return 0
    model, hardware = load_model(args.model), load_hardware(args.gpu)
    slo = SLO.parse(args.slo)
    if args.trace and args.rate:
        raise ValueError("--rate and --trace are exclusive (a trace carries its arrival times)")
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    configs = [
        SimConfig(model=model, hardware=hardware, tp=args.tp, policy=policy, queue=queue,
                  preemption_mode=args.preemption_mode, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, block_size=args.block_size,
                  num_gpu_blocks=args.num_gpu_blocks, swap_space_gb=args.swap_space,
                  enable_prefix_caching=args.enable_prefix_caching,
                  long_prefill_token_threshold=args.long_prefill_token_threshold,
                  max_num_partial_prefills=args.max_num_partial_prefills)
        for policy in args.policy for queue in args.queue
    ]
    cost = CostModel(model, hardware, args.tp, args.block_size)  # fails early on a bad fit
    num_gpu_blocks = args.num_gpu_blocks or cost.num_gpu_blocks()
    if args.pd:
        from conveyor.sim.pd_cli import run_pd

        return run_pd(args, configs, slo)
    if args.trace:
        trace = load_trace(args.trace)
        span = float(trace.arrival_s[-1] - trace.arrival_s[0])
        workloads = [(len(trace) / span if span > 0 else math.inf, trace)]
    else:
        workloads = [(rate, generate(args.requests, rate, args.input_len, args.output_len,
                                     args.arrival, args.priorities, args.seed))
                     for rate in (args.rate or [10.0])]
        if args.save_trace:
            workloads[0][1].save_jsonl(args.save_trace)

    if args.rate_per_gpu:
        raise ValueError("--rate-per-gpu compares systems of different sizes: use it with --pd")
    if args.replicas is None:
        args.replicas = 1
    if args.replicas > 1 or args.shared_prefix:
        return _run_fleet(args, configs, workloads, slo, num_gpu_blocks)
    print(f"{model.name} on {args.tp} x {hardware.name}: {num_gpu_blocks:,} KV blocks x "
          f"{args.block_size} tokens, weights {model.weight_bytes_total / 1e9:.1f} GB; SLO {slo}")
    results, summaries = [], []
    for rate, workload in workloads:
        for config in configs:
            result = simulate(config, workload, rate=rate)
            summary = result.summary(slo)
            results.append(result)
            summaries.append(summary)
            print(f"  {config.label} @ {rate:g} req/s: {summary['output_tok_s']:.0f} out tok/s, "
                  f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms, TPOT p50 {summary['tpot_p50_ms']:.1f} ms "
                  f"({result.num_steps:,} steps, {result.wall_s:.1f} s)", flush=True)
    print()
    print(report.format_table(summaries))

    header = {
        "model": model.name, "hardware": hardware.name, "tp": args.tp,
        "workload": workloads[0][1].name if args.trace else
        f"{args.requests} requests, {args.arrival} arrivals, input {args.input_len}, "
        f"output {args.output_len}, priorities {args.priorities}, seed {args.seed}",
        "slo": str(slo), "num_gpu_blocks": num_gpu_blocks, "block_size": args.block_size,
        "engine": ", ".join(f"{k}={v}" for k, v in configs[0].describe().items()
                            if k not in ("model", "hardware", "policy", "queue")),
        "command": "conveyor simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "simulate" else "conveyor simulate",
    }
    plots = []
    if args.plot:
        from conveyor.sim.plots import write_plots

        plots = write_plots(results, summaries, args.plot)
        print(f"plots: {', '.join(str(p) for p in plots)}")
    if args.json:
        report.write_json(args.json, header, summaries)
        print(f"json: {args.json}")
    if args.report:
        report.write_markdown(args.report, header, summaries, plots)
        print(f"report: {args.report}")
    return 0


def _shared_prefix(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    groups, _, length = text.partition(":")
    try:
        return int(groups), int(length)
    except ValueError:
        raise ValueError(f"bad --shared-prefix {text!r}: use GROUPS:TOKENS, e.g. 16:512") from None


def _run_fleet(args: argparse.Namespace, configs, workloads, slo, num_gpu_blocks: int) -> int:
    from conveyor.routing import make_router
    from conveyor.sim import report
    from conveyor.sim.fleet import simulate_fleet

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    for router in args.router:
        make_router(router)
    shared = _shared_prefix(args.shared_prefix)
    print(f"{args.replicas} replicas of {configs[0].model.name} on {args.tp} x "
          f"{configs[0].hardware.name} (each {num_gpu_blocks:,} KV blocks x {args.block_size} "
          f"tokens); SLO {slo}; shared prefix {args.shared_prefix or 'none'}")
    summaries = []
    for rate, workload in workloads:
        for config in configs:
            for router in args.router:
                fleet = simulate_fleet(config, workload, args.replicas, router, rate=rate,
                                       shared_prefix=shared, seed=args.seed)
                summary = fleet.summary(slo)
                summaries.append(summary)
                print(f"  {config.label} x{args.replicas} {router} @ {rate:g} req/s: "
                      f"{summary['output_tok_s']:.0f} out tok/s, TTFT p50 "
                      f"{summary['ttft_p50_ms']:.0f} ms, prefix hit rate "
                      f"{summary['prefix_hit_rate']:.1%} ({fleet.result.wall_s:.1f} s)",
                      flush=True)
                print(report.format_replica_table(summary["per_replica"]))
    print()
    print(report.format_table(summaries))
    if args.json:
        header = {"model": configs[0].model.name, "hardware": configs[0].hardware.name,
                  "tp": args.tp, "replicas": args.replicas, "slo": str(slo),
                  "shared_prefix": args.shared_prefix}
        report.write_json(args.json, header, summaries)
        print(f"json: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``conveyor simulate`` on its own (``python -m conveyor.sim.cli ...``)."""
    parser = argparse.ArgumentParser(prog="conveyor")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
