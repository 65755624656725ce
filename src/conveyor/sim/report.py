"""Text table, JSON and markdown report of simulated runs (one summary dict per run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

COLUMNS = [  # (header, key, format)
    ("policy", "label", "{}"),
    ("rate", "rate", "{:g}"),
    ("req/s", "throughput_req_s", "{:.2f}"),
    ("out tok/s", "output_tok_s", "{:.0f}"),
    ("TTFT p50/p90/p99 ms", ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"), "{:.0f}"),
    ("TPOT p50/p90/p99 ms", ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"), "{:.1f}"),
    ("E2E p50/p90/p99 s", ("e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms"), "s"),
    ("preempt", "preemptions", "{}"),
    ("KV mean/peak", ("kv_usage_mean", "kv_usage_peak"), "%"),
    ("goodput req/s", "goodput_req_s", "{:.2f}"),
    ("SLO met", "slo_attainment", "{:.0%}"),
]


def _cell(summary: dict, key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    parts = []
    for k in keys:
        v = summary[k]
        if isinstance(v, float) and math.isnan(v):
            parts.append("-")
        elif fmt == "s":
            parts.append(f"{v / 1e3:.1f}")
        elif fmt == "%":
            parts.append(f"{v:.0%}")
        else:
            parts.append(fmt.format(v))
    return "/".join(parts)


def rows(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [h for h, _, _ in COLUMNS]
    return header, [[_cell(s, k, f) for _, k, f in COLUMNS] for s in summaries]


def format_table(summaries: list[dict]) -> str:
    header, body = rows(summaries)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


REPLICA_COLUMNS = [  # (header, key, format) of a fleet run's per-replica rows
    ("replica", "replica", "{}"), ("requests", "requests", "{}"),
    ("affinity hits", "affinity_hits", "{}"), ("out tokens", "output_tokens", "{}"),
    ("busy", "busy", "{:.0%}"), ("steps", "steps", "{}"), ("preempt", "preemptions", "{}"),
    ("prefix hit", "prefix_hit_rate", "{:.1%}"), ("KV mean", "kv_usage_mean", "{:.0%}"),
]


def format_replica_table(per_replica: list[dict]) -> str:
    """Per-replica load of one fleet run, indented under its summary line."""
    header = [h for h, _, _ in REPLICA_COLUMNS]
    body = [[_cell(r, k, f) for _, k, f in REPLICA_COLUMNS] for r in per_replica]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("    " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False))
                     for r in [header, *body])


def format_markdown_table(summaries: list[dict]) -> str:
    header, body = rows(summaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars
        return _jsonable(value.item())
    return value


def write_json(path: str | Path, header: dict, summaries: list[dict]) -> None:
    Path(path).write_text(json.dumps(_jsonable({**header, "runs": summaries}), indent=2) + "\n")


def write_markdown(path: str | Path, header: dict, summaries: list[dict],
                   plots: list[Path] = ()) -> None:
    path = Path(path)
    lines = [
        f"# Simulation: {header['model']} on {header['tp']} x {header['hardware']}",
        "",
        f"- workload: {header['workload']}",
        f"- SLO for goodput: {header['slo']}",
        f"- KV cache: {header['num_gpu_blocks']} blocks of {header['block_size']} tokens "
        f"({header['num_gpu_blocks'] * header['block_size']:,} tokens)",
        f"- engine: {header['engine']}",
        f"- command: `{header['command']}`",
        "",
        format_markdown_table(summaries),
        "",
        "TTFT: arrival to first token; TPOT: mean time per output token after the first; "
        "E2E: arrival to last token; goodput: requests/s meeting the SLO on both TTFT and TPOT. "
        "Latencies come from the scheduler's virtual clock; step times from the roofline cost "
        "model (docs/simulation.md).",
    ]
    for p in plots:
        rel = Path(p).resolve().relative_to(path.resolve().parent) \
            if Path(p).resolve().is_relative_to(path.resolve().parent) else Path(p).resolve()
        lines += ["", f"![{Path(p).stem}]({rel.as_posix()})"]
    path.write_text("\n".join(lines) + "\n")
