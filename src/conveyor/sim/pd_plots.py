"""The goodput figure of a colocated-vs-disaggregated sweep (DistServe's): SLO attainment, P90
TTFT and P90 TPOT against the per-GPU rate, and the per-GPU goodput against the SLO scale."""

from __future__ import annotations

import math
from pathlib import Path

from conveyor.sim.metrics import SLO
from conveyor.sim.pd_goodput import Point, slo_scale_table
from conveyor.sim.plots import _plain_log_labels, _pyplot


def _by_system(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.system.name, []).append(p)
    return {name: sorted(runs, key=lambda p: p.rate_per_gpu) for name, runs in out.items()}


def goodput_figure(points: list[Point], slo: SLO, scales: list[float], target: float,
                   path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.3))
    systems = _by_system(points)
    styles = {name: ("--" if runs[0].system.disaggregated else "-")
              for name, runs in systems.items()}
    att, ttft, tpot, scale_ax = axes
    for name, runs in systems.items():
        rates = [p.rate_per_gpu for p in runs]
        summaries = [p.result.summary(slo) for p in runs]
        att.plot(rates, [100 * p.attainment(slo) for p in runs], styles[name], marker="o",
                 label=name)
        ttft.plot(rates, [s["ttft_p90_ms"] for s in summaries], styles[name], marker="o",
                  label=name)
        tpot.plot(rates, [s["tpot_p90_ms"] for s in summaries], styles[name], marker="o",
                  label=name)
    att.axhline(100 * target, color="gray", lw=0.8, ls=":")
    att.set_ylabel("SLO attainment (%)")
    att.set_title(f"both SLOs met ({slo})", fontsize=9)
    ttft.axhline(slo.ttft_s * 1e3, color="gray", lw=0.8, ls=":")
    ttft.set_title("P90 TTFT (ms); dotted: SLO", fontsize=9)
    ttft.set_yscale("log")
    tpot.axhline(slo.tpot_s * 1e3, color="gray", lw=0.8, ls=":")
    tpot.set_title("P90 TPOT (ms); dotted: SLO", fontsize=9)
    for ax in (att, ttft, tpot):
        ax.set_xlabel("rate per GPU (req/s)")
    table = slo_scale_table(points, slo, scales, target)
    for name, row in table.items():
        values = [v if not bound else math.nan for v, bound in row]  # bounds are not values
        scale_ax.plot(scales, values, styles[name], marker="o", label=name)
        for s, (v, bound) in zip(scales, row, strict=True):
            if bound == ">=":
                scale_ax.plot([s], [v], "^", color=scale_ax.lines[-1].get_color(), alpha=0.5)
    scale_ax.set_xlabel("SLO scale (both targets times this)")
    scale_ax.set_title(f"per-GPU goodput: max rate at {target:.0%} attainment\n"
                       "(▲: every swept rate met it)", fontsize=9)
    scale_ax.set_xscale("log")
    _plain_log_labels(scale_ax.xaxis)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
