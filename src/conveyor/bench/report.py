"""Benchmark results as plain data, and their table, JSON and plot forms.

A throughput run yields one ``SystemResult`` per system configuration (Conveyor, each peer),
each holding its timed repeats; every peer figure is shown as a ratio to Conveyor's (the first
Conveyor row). A serving run yields one summary dict per request rate (see serving.py). Every
result file a bench command writes goes through ``write_result``: the command line and the
provenance block (provenance.py) with the payload.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.bench.provenance import provenance
from conveyor.bench.workloads import is_single_stream


@dataclass
class Measurement:
    """One timed repeat of a workload on one system."""

    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # single stream only
    decode_tokens_per_s: float | None = None  # single stream only

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


@dataclass
class SystemResult:
    """All repeats of one system configuration, or the reason it did not run."""

    system: str  # conveyor | transformers | transformers-cb | llamacpp
    config: str  # human-readable setting, e.g. "bfloat16, static batch 64"
    repeats: list[Measurement] = field(default_factory=list)
    skipped: str | None = None  # e.g. "skipped (not installed)"
    load_s: float | None = None
    peak_rss_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # profile, memory budget, sweeps

    @property
    def label(self) -> str:
        return f"{self.system} ({self.config})" if self.config else self.system

    def best_and_median(self, metric: str, lower_is_better: bool = False) -> tuple[float, float]:
        values = [getattr(m, metric) for m in self.repeats]
        values = [v for v in values if v is not None]
        if not values:
            return math.nan, math.nan
        best = min(values) if lower_is_better else max(values)
        return best, statistics.median(values)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SystemResult:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields = Measurement.__dataclass_fields__
        known["repeats"] = [Measurement(**{k: v for k, v in m.items() if k in fields})
                            for m in d.get("repeats", [])]
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for m, raw in zip(self.repeats, d["repeats"], strict=True):
            raw["output_tokens_per_s"] = m.output_tokens_per_s
            raw["total_tokens_per_s"] = m.total_tokens_per_s
        return d


# (metric attribute, column title, lower is better)
THROUGHPUT_COLUMNS = [
    ("output_tokens_per_s", "output tok/s", False),
    ("total_tokens_per_s", "total tok/s", False),
    ("wall_s", "wall s", True),
]
SINGLE_STREAM_COLUMNS = [
    ("ttft_s", "TTFT ms", True),
    ("decode_tokens_per_s", "decode tok/s", False),
    ("wall_s", "wall s", True),
]


def headline_columns(single_stream: bool) -> list[tuple[str, str, bool]]:
    return SINGLE_STREAM_COLUMNS if single_stream else THROUGHPUT_COLUMNS


def ratio(value: float, reference: float) -> float:
    if not reference or math.isnan(reference) or math.isnan(value):
        return math.nan
    return value / reference


def _fmt(value: float, scale: float = 1.0) -> str:
    if value is None or math.isnan(value):
        return "-"
    v = value * scale
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def format_table(results: list[SystemResult], single_stream: bool = False) -> str:
    """A Markdown table: best / median of the repeats, and each row's ratio to Conveyor's.

    The ratio columns compare best to best (min of the repeats' wall time) for every metric.
    """
    columns = headline_columns(single_stream)
    reference = next((r for r in results if r.system == "conveyor" and r.repeats), None)
    header = ["system", "config"]
    for _, title, _ in columns:
        header.append(f"{title} best / median")
    header += [f"{title} vs conveyor" for _, title, _ in columns[:2]] + ["repeats", "peak RSS MB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if r.skipped:
            cells = [r.system, r.config or "", r.skipped] + [""] * (len(header) - 3)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [r.system, r.config]
        for metric, title, lower in columns:
            scale = 1000.0 if title.endswith("ms") else 1.0
            best, median = r.best_and_median(metric, lower)
            cells.append(f"{_fmt(best, scale)} / {_fmt(median, scale)}")
        for metric, _, lower in columns[:2]:
            ref = reference.best_and_median(metric, lower)[0] if reference else math.nan
            x = ratio(r.best_and_median(metric, lower)[0], ref)
            cells.append("-" if math.isnan(x) else f"{x:.2f}x")
        cells.append(str(len(r.repeats)))
        cells.append(_fmt(r.peak_rss_mb) if r.peak_rss_mb else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# systems in the order a summary's columns take, with the names they go by there
SYSTEM_NAMES = {"conveyor": "Conveyor", "vllm": "vLLM", "transformers": "transformers",
                "transformers-cb": "transformers (continuous batching)", "llamacpp": "llama.cpp",
                "llamacpp-lookup": "llama.cpp prompt lookup"}


def format_summary_table(runs: list[tuple[str, list[SystemResult]]]) -> str:
    """Several workloads' runs on one machine as one Markdown table: a row per (workload, headline
    metric), a column per system (its first timed row: for Conveyor the engine flags as given),
    best / median of the repeats, the best of each row in bold."""
    systems = [s for s in SYSTEM_NAMES if any(r.system == s for _, rs in runs for r in rs)]
    systems += sorted({r.system for _, rs in runs for r in rs} - set(systems))
    header = ["workload", "measure", *(SYSTEM_NAMES.get(s, s) for s in systems)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload, results in runs:
        first: dict[str, SystemResult] = {}
        for r in results:
            if r.repeats:
                first.setdefault(r.system, r)
        single = is_single_stream(workload)
        for metric, title, lower in headline_columns(single)[:2 if single else 1]:
            scale = 1000.0 if title.endswith("ms") else 1.0
            figures = {s: r.best_and_median(metric, lower) for s, r in first.items()}
            pick = min if lower else max
            leader = pick(figures, key=lambda s: figures[s][0])
            cells = [workload, f"{title}, best / median"]
            for s in systems:
                if s not in figures:
                    cells.append("")
                    continue
                best, median = (_fmt(v, scale) for v in figures[s])
                best = f"**{best}**" if s == leader else best
                cells.append(f"{best} (one run)" if len(first[s].repeats) == 1
                             else f"{best} / {median}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")


def write_result(path: str | Path, payload: dict[str, Any],
                 peers: dict[str, str | None] | None = None) -> None:
    """A result file: the command line that ran, its provenance (``peers``: distribution ->
    version of each peer that ran), then ``payload``."""
    write_json(path, {"command": " ".join(["conveyor", *sys.argv[1:]]),
                      "provenance": provenance(peers), **payload})


def plot_throughput(results: list[SystemResult], path: str | Path, title: str,
                    single_stream: bool = False) -> None:
    """Bar chart of the headline metric (best of repeats, median as a dot) per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.repeats]
    metric, label, lower = headline_columns(single_stream)[1 if single_stream else 0]
    best = [r.best_and_median(metric, lower)[0] for r in ran]
    median = [r.best_and_median(metric, lower)[1] for r in ran]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(ran) + 2), 4.5))
    colors = ["tab:blue" if r.system == "conveyor" else "tab:gray" for r in ran]
    bars = ax.bar(range(len(ran)), best, color=colors)
    ax.scatter(range(len(ran)), median, color="black", zorder=3, s=12, label="median")
    for bar, value in zip(bars, best, strict=True):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ran)), [r.system + "\n" + textwrap.fill(r.config, 24) for r in ran],
                  fontsize=7)
    ax.set_ylabel(f"{label} (bar: best of repeats)")
    ax.set_title(textwrap.fill(title, 70), fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    skipped = [r.label + ": " + r.skipped for r in results if r.skipped]
    if skipped:
        fig.text(0.01, 0.01, "; ".join(skipped), fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------- serving

def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation); NaN when there are no values."""
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99")}
    xs = sorted(values)

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": statistics.fmean(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


SERVING_LATENCIES = ["ttft", "tpot", "itl", "e2e"]


def format_serving_table(runs: list[dict[str, Any]]) -> str:
    """One row per (label, request rate); latencies in ms."""
    header = ["label", "rate req/s", "done/sent", "req/s", "out tok/s", "goodput req/s",
              "preemptions"]
    for name in SERVING_LATENCIES:
        header.append(f"{name.upper()} ms mean / p50 / p90 / p99")
    hit_rates = any("prefix_hit_rate" in run for run in runs)
    if hit_rates:
        header.append("prefix hit rate")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        rate = run["request_rate"]
        cells = [run.get("label", ""), "inf" if rate in (None, math.inf) else f"{rate:g}",
                 f"{run['completed']}/{run['sent']}", _fmt(run["request_throughput"]),
                 _fmt(run["output_throughput"]), _fmt(run.get("goodput", math.nan)),
                 "-" if run.get("preemptions") is None else str(run["preemptions"])]
        for name in SERVING_LATENCIES:
            p = run[name]
            cells.append(" / ".join(_fmt(p[k], 1000.0) for k in ("mean", "p50", "p90", "p99")))
        if hit_rates:
            hit = run.get("prefix_hit_rate")
            tier = run.get("offload_hit_rate")
            cells.append("-" if hit is None else f"{hit:.1%}" + (
                "" if tier is None else f" ({tier:.1%} from offload)"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_serving(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Latency vs request rate: TTFT, TPOT and E2E p50 (solid) and p99 (dashed), one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = _rate_positions(runs)
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_label.setdefault(run.get("label") or "run", []).append(run)
    panels = [("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(16, 4.2))
    for i, (label, items) in enumerate(sorted(by_label.items())):
        color = f"C{i}"
        items = sorted(items, key=lambda r: _rate_key(r["request_rate"]))
        rates = [positions[_rate_key(r["request_rate"])] for r in items]
        for ax, (key, name) in zip(axes, panels, strict=False):
            ax.plot(rates, [r[key]["p50"] * 1000 for r in items], "o-", color=color,
                    label=f"{label} p50")
            ax.plot(rates, [r[key]["p99"] * 1000 for r in items], "x--", color=color,
                    label=f"{label} p99")
            ax.set_title(f"{name} (ms)", fontsize=10)
        axes[-1].plot(rates, [r["output_throughput"] for r in items], "o-", color=color,
                      label=label)
        axes[-1].set_title("output tok/s", fontsize=10)
    for ax in axes:
        ax.set_xlabel("request rate (req/s; inf plotted at the right end)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate_positions(runs: list[dict[str, Any]]) -> dict[float, float]:
    """x position per rate: an unbounded rate (inf / None) sits at 1.5x the largest finite one."""
    finite = [float(r["request_rate"]) for r in runs
              if r["request_rate"] is not None and math.isfinite(float(r["request_rate"]))]
    inf_at = 1.5 * max(finite) if finite else 1.0
    return {rate: rate for rate in finite} | {math.inf: inf_at}


def _rate_key(rate: float | None) -> float:
    return math.inf if rate is None else float(rate)
