"""``conveyor simulate --pd P:D``: disaggregated fleets against a colocated one, per GPU.

Every system (colocated ``--replicas`` N, default P + D of the first ``--pd``; each ``--pd``
P:D) runs the same seeded workload at each rate: ``--rate-per-gpu`` (each system's total is
that times its GPUs, DistServe's axis) or ``--rate`` (the same total for all). Prints a row
per run and the per-GPU goodput at ``--attainment`` as the SLO is scaled by ``--slo-scale``;
``--plot DIR`` writes ``pd_goodput.png``, ``--report`` a markdown page, ``--json`` the runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from conveyor.sim import pd_report
from conveyor.sim.kv_link import parse_link
from conveyor.sim.metrics import SLO
from conveyor.sim.pd_fleet import parse_pd
from conveyor.sim.pd_goodput import Point, System, sweep
from conveyor.sim.runner import SimConfig
from conveyor.sim.workload import generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--pd", default=None, metavar="P:D[,P:D...]",
                   help="disaggregated systems of P prefill and D decode instances, compared "
                        "with --replicas colocated ones (default: P+D of the first)")
    g.add_argument("--kv-link", default="nvlink",
                   help="link carrying KV blocks to a decode instance: nvlink (the GPU spec's "
                        "interconnect), pcie (its host link), rdma (50 GB/s) or GB/s "
                        "(default: nvlink)")
    g.add_argument("--rate-per-gpu", default=None, metavar="R[,R...]",
                   help="request rates per GPU (each system's total is that times its GPUs); "
                        "instead of --rate")
    g.add_argument("--slo-scale", default="0.5,0.75,1,1.5,2,3",
                   help="SLO scales for the per-GPU goodput table (default: 0.5,0.75,1,1.5,2,3)")
    g.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLO (default: 0.9, DistServe's)")


def _positive_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise ValueError(f"bad {flag} {text!r}: use positive numbers, comma-separated")
    return values


def run_pd(args: argparse.Namespace, configs: list[SimConfig], slo: SLO) -> int:
    if args.trace:
        raise ValueError("--pd sweeps generated workloads; --trace is not supported with it")
    if args.rate and args.rate_per_gpu:
        raise ValueError("--rate and --rate-per-gpu are exclusive")
    if len(args.router) != 1:
        raise ValueError("--pd takes one --router (prefill and decode instances each use it)")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    shapes = [parse_pd(t) for t in args.pd.split(",") if t.strip()]
    if not shapes:
        raise ValueError(f"bad --pd {args.pd!r}: use PREFILL:DECODE, e.g. 1:1")
    replicas = args.replicas if args.replicas is not None else sum(shapes[0])
    if replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {replicas}")
    scales = _positive_list(args.slo_scale, "--slo-scale")
    hardware = configs[0].hardware
    link = parse_link(args.kv_link, hardware)
    per_gpu = args.rate_per_gpu is not None
    rates = _positive_list(args.rate_per_gpu, "--rate-per-gpu") if per_gpu \
        else (args.rate or [10.0])
    systems = [System(c, replicas) for c in configs if replicas] + \
        [System(c, p, d) for c in configs for p, d in shapes]
    router = args.router[0]
    print(f"{configs[0].model.name} on {hardware.name} (tp {args.tp} per instance): "
          f"{', '.join(s.name for s in systems)}; router {router}; KV link {link}; SLO {slo}")

    def progress(point: Point) -> None:
        s = point.summary(slo)
        extra = (f", KV transfer p50 {s['kv_transfer_p50_ms']:.2f} ms, decode wait p50 "
                 f"{s['decode_admit_wait_p50_ms']:.1f} ms" if point.system.disaggregated else "")
        print(f"  {point.system.name} @ {point.rate_per_gpu:g} req/s/GPU: SLO met "
              f"{point.attainment(slo):.0%}, TTFT p90 {s['ttft_p90_ms']:.0f} ms, TPOT p90 "
              f"{s['tpot_p90_ms']:.1f} ms{extra} ({point.result.wall_s:.1f} s)", flush=True)

    def workload_at(total: float):
        return generate(args.requests, total, args.input_len, args.output_len, args.arrival,
                        args.priorities, args.seed)

    points = sweep(systems, rates, workload_at, router, link, per_gpu, progress)
    print()
    print(pd_report.text_table(*pd_report.run_rows(points, slo)))
    print()
    print(pd_report.scale_caption(slo, args.attainment))
    print(pd_report.text_table(*pd_report.scale_rows(points, slo, scales, args.attainment)))

    header = {
        "model": configs[0].model.name, "hardware": hardware.name, "tp": args.tp,
        "workload": f"{args.requests} requests per run, {args.arrival} arrivals, input "
                    f"{args.input_len}, output {args.output_len}, seed {args.seed}",
        "router": router, "kv_link": str(link), "slo": str(slo),
        "attainment": args.attainment,
        "command": "conveyor simulate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "simulate" else "conveyor simulate",
    }
    plots = []
    if args.plot:
        from pathlib import Path

        from conveyor.sim.pd_plots import goodput_figure

        title = (f"{header['model']} on {hardware.name}: colocated vs disaggregated "
                 f"(input {args.input_len}, output {args.output_len})")
        plots.append(goodput_figure(points, slo, scales, args.attainment,
                                    Path(args.plot) / "pd_goodput.png", title))
        print(f"plots: {', '.join(str(p) for p in plots)}")
    if args.json:
        from conveyor.sim.pd_goodput import slo_scale_table
        from conveyor.sim.report import write_json

        table = slo_scale_table(points, slo, scales, args.attainment)
        rates_at = {name: [v for v, _ in row] for name, row in table.items()}
        write_json(args.json, {**header, "slo_scales": scales, "max_rate_per_gpu": rates_at},
                   [p.summary(slo) for p in points])
        print(f"json: {args.json}")
    if args.report:
        pd_report.write_markdown(args.report, header, points, slo, scales, args.attainment,
                                 plots)
        print(f"report: {args.report}")
    return 0
