"""PNG plots of simulated runs: latency vs request rate, and CDFs of TTFT and TPOT per policy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from conveyor.sim.metrics import RunResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_labels(axis) -> None:
    """Label a log axis 7, 8, 10, 20 rather than 7x10^0 (minor ticks only on a short range)."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(fmt)
    low, high = axis.get_view_interval()
    if low > 0 and high / low < 20:
        axis.set_minor_formatter(fmt)


def latency_vs_rate(results: list[RunResult], summaries: list[dict], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = list(dict.fromkeys(s["label"] for s in summaries))
    panels = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("goodput", "goodput (req/s)"))
    for ax, (metric, title) in zip(axes, panels, strict=False):
        for label in labels:
            runs = sorted((s for s in summaries if s["label"] == label), key=lambda s: s["rate"])
            rates = [s["rate"] for s in runs]
            if metric == "goodput":
                ax.plot(rates, [s["goodput_req_s"] for s in runs], marker="o", label=label)
                continue
            for p, style in ((50, "-"), (99, "--")):
                ax.plot(rates, [s[f"{metric}_p{p}_ms"] for s in runs], style, marker="o",
                        label=f"{label} p{p}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if metric != "goodput":
            ax.set_yscale("log")
            _plain_log_labels(ax.yaxis)
        ax.legend(fontsize=7)
    first = summaries[0]
    fig.suptitle(f"{first['model']} on {first['tp']} x {first['hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cdfs(results: list[RunResult], rate: float, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (name, title) in zip(axes, (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)")), strict=False):
        for r in results:
            if r.rate != rate and not (math.isnan(r.rate) and math.isnan(rate)):
                continue
            v = np.sort(getattr(r, name)) * 1e3
            v = v[~np.isnan(v)]
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.label)
        ax.set_xscale("log")
        _plain_log_labels(ax.xaxis)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"CDFs at {rate:g} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: list[RunResult], summaries: list[dict], directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if len({s["rate"] for s in summaries}) > 1:
        paths.append(latency_vs_rate(results, summaries, out / "latency_vs_rate.png"))
    for rate in dict.fromkeys(r.rate for r in results):
        paths.append(cdfs(results, rate, out / f"cdf_rate_{rate:g}.png"))
    return paths
