"""DistServe's comparison: per-GPU goodput of colocated against disaggregated serving.

A *system* is N colocated replicas (``sim/fleet.py``) or P prefill + D decode instances
(``sim/pd_fleet.py``) of one engine config; it uses ``(N or P + D) * tp`` GPUs. Every system
runs the same seeded workload at each per-GPU rate (its total rate is that times its GPUs).
From the runs, with no further simulation:

* SLO attainment: the share of requests that met both the TTFT and the TPOT target;
* per-GPU goodput: the highest per-GPU rate whose attainment is at least the target (DistServe:
  90%), read off the swept rates with linear interpolation between the last rate that meets it
  and the first that does not;
* the same as the SLO is scaled (both targets times a factor: DistServe's "SLO scale").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.sim.fleet import simulate_fleet
from conveyor.sim.kv_link import LinkSpec
from conveyor.sim.metrics import SLO, RunResult
from conveyor.sim.pd_fleet import simulate_pd
from conveyor.sim.runner import SimConfig
from conveyor.sim.workload import Workload


@dataclass(frozen=True)
class System:
    """Colocated (``num_decode == 0``: ``num_prefill`` plain replicas) or disaggregated."""

    config: SimConfig
    num_prefill: int
    num_decode: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.num_decode > 0

    @property
    def num_gpus(self) -> int:
        return (self.num_prefill + self.num_decode) * self.config.tp

    @property
    def name(self) -> str:
        shape = f"PD {self.num_prefill}:{self.num_decode}" if self.disaggregated \
            else f"colocated x{self.num_prefill}"
        return f"{shape} ({self.config.policy})"

    def run(self, workload: Workload, rate: float, router: str,
            link: LinkSpec) -> tuple[RunResult, dict]:
        """The run, and what a disaggregated one adds to its summary (KV transfers, decode
        admission waits: ``PDResult.summary``'s extra keys)."""
        if self.disaggregated:
            pd = simulate_pd(self.config, workload, self.num_prefill, self.num_decode, router,
                             link, rate=rate)
            result, extra = pd.result, pd.pd_summary()
        else:
            result, extra = simulate_fleet(self.config, workload, self.num_prefill, router,
                                           rate=rate).result, {}
        result.label = self.name
        return result, extra


@dataclass
class Point:
    """One run: a system at a per-GPU rate."""

    system: System
    rate_per_gpu: float
    result: RunResult
    extra: dict  # a disaggregated run's KV-transfer figures

    def summary(self, slo: SLO) -> dict:
        return {**self.result.summary(slo), **self.extra, "system": self.system.name,
                "num_gpus": self.system.num_gpus, "rate_per_gpu": self.rate_per_gpu,
                "goodput_per_gpu": self.goodput_per_gpu(slo)}

    def attainment(self, slo: SLO) -> float:
        return float(self.result.meets(slo).mean()) if len(self.result.arrival_s) else math.nan

    def goodput_per_gpu(self, slo: SLO) -> float:
        """Requests/s meeting the SLO, per GPU."""
        span = self.result.makespan_s
        return float(self.result.meets(slo).sum()) / span / self.system.num_gpus \
            if span > 0 else math.nan


def sweep(systems: list[System], rates: list[float], workload_at, router: str,
          link: LinkSpec, per_gpu: bool = True, progress=None) -> list[Point]:
    """Every system at every rate (per GPU, or the total when ``per_gpu`` is false);
    ``workload_at(total_rate)`` makes the workload (same seed: same lengths, arrivals scaled);
    ``progress(point)`` after each run."""
    points = []
    for rate in rates:
        for system in systems:
            total = rate * system.num_gpus if per_gpu else rate
            result, extra = system.run(workload_at(total), total, router, link)
            point = Point(system, total / system.num_gpus, result, extra)
            points.append(point)
            if progress is not None:
                progress(point)
    return points


def max_rate(points: list[Point], slo: SLO, target: float = 0.9) -> tuple[float, str]:
    """The highest per-GPU rate at which ``points`` (one system's) reach ``target`` attainment,
    and how it was found: "" (interpolated), ">=" (every swept rate meets it: a lower bound) or
    "<" (none does: below the lowest rate swept)."""
    runs = sorted(points, key=lambda p: p.rate_per_gpu)
    if not runs:
        return math.nan, ""
    if runs[0].attainment(slo) < target:
        return runs[0].rate_per_gpu, "<"
    for low, high in zip(runs, runs[1:], strict=False):
        a_low, a_high = low.attainment(slo), high.attainment(slo)
        if a_high < target:
            share = (a_low - target) / (a_low - a_high)
            return low.rate_per_gpu + share * (high.rate_per_gpu - low.rate_per_gpu), ""
    return runs[-1].rate_per_gpu, ">="


def slo_scale_table(points: list[Point], slo: SLO, scales: list[float],
                    target: float = 0.9) -> dict[str, list[tuple[float, str]]]:
    """System name -> its (max per-GPU rate, bound) at each SLO scale."""
    by_system: dict[str, list[Point]] = {}
    for p in points:
        by_system.setdefault(p.system.name, []).append(p)
    return {name: [max_rate(runs, slo.scaled(s), target) for s in scales]
            for name, runs in by_system.items()}


def format_rate(value: float, bound: str) -> str:
    return f"{bound}{value:.2f}" if math.isfinite(value) else "-"
