"""Tables of a colocated-vs-disaggregated sweep: one row per run, and per-GPU goodput against the
SLO scale; as aligned text or markdown, and a markdown page with the figure."""

from __future__ import annotations

import math
from pathlib import Path

from conveyor.sim.metrics import SLO
from conveyor.sim.pd_goodput import Point, format_rate, slo_scale_table


def _ms(value: float, digits: int = 0) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{digits}f}"


def run_rows(points: list[Point], slo: SLO) -> tuple[list[str], list[list[str]]]:
    header = ["system", "GPUs", "rate/GPU", "TTFT p50/p90 ms", "TPOT p50/p90 ms",
              "SLO met", "goodput/GPU", "KV transfer p50 ms", "decode wait p50 ms"]
    body = []
    order = {name: i for i, name in enumerate(dict.fromkeys(p.system.name for p in points))}
    for p in sorted(points, key=lambda p: (order[p.system.name], p.rate_per_gpu)):
        s = p.summary(slo)
        body.append([
            p.system.name, str(p.system.num_gpus), f"{p.rate_per_gpu:g}",
            f"{_ms(s['ttft_p50_ms'])}/{_ms(s['ttft_p90_ms'])}",
            f"{_ms(s['tpot_p50_ms'], 1)}/{_ms(s['tpot_p90_ms'], 1)}",
            f"{p.attainment(slo):.0%}", f"{s['goodput_per_gpu']:.2f}",
            _ms(s.get("kv_transfer_p50_ms", math.nan), 2),
            _ms(s.get("decode_admit_wait_p50_ms", math.nan), 1)])
    return header, body


def scale_rows(points: list[Point], slo: SLO, scales: list[float],
               target: float) -> tuple[list[str], list[list[str]]]:
    header = ["system"] + [f"x{s:g}" for s in scales]
    table = slo_scale_table(points, slo, scales, target)
    return header, [[name] + [format_rate(*v) for v in row] for name, row in table.items()]


def text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
             for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def scale_caption(slo: SLO, target: float) -> str:
    return (f"Per-GPU goodput: the highest rate per GPU (req/s) with at least {target:.0%} of "
            f"requests meeting both targets, as the SLO ({slo}) is scaled; '>=': every swept "
            "rate met it, '<': none did.")


def write_markdown(path: str | Path, header: dict, points: list[Point], slo: SLO,
                   scales: list[float], target: float, plots: list[Path] = ()) -> None:
    path = Path(path)
    lines = [f"# Disaggregated vs colocated: {header['model']} on {header['hardware']}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k not in ("model", "hardware")]
    lines += ["", markdown_table(*run_rows(points, slo)), "",
              scale_caption(slo, target), "",
              markdown_table(*scale_rows(points, slo, scales, target))]
    for p in plots:
        p = Path(p).resolve()
        rel = p.relative_to(path.resolve().parent) if p.is_relative_to(path.resolve().parent) \
            else p
        lines += ["", f"![{p.stem}]({rel.as_posix()})"]
    path.write_text("\n".join(lines) + "\n")
