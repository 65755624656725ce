"""Results of one simulated run: per-request latencies, run counters, and their summary under an SLO.

Definitions (vLLM's benchmark conventions): TTFT = first token time - arrival; TPOT = (finish -
first token) / (output tokens - 1), for requests with at least 2 output tokens; E2E = finish -
arrival. Throughput divides by the makespan (first arrival to last finish). Goodput counts the
requests that met both SLO targets, per second of makespan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.05

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=500ms,tpot=50ms`` (units ms or s; a bare number is seconds)."""
        values = {"ttft": cls.ttft_s, "tpot": cls.tpot_s}
        for part in text.split(","):
            key, _, value = part.strip().partition("=")
            if key not in values or not value:
                raise ValueError(f"bad --slo {text!r}: use ttft=VALUE,tpot=VALUE (e.g. ttft=1s,tpot=50ms)")
            scale = 1.0
            if value.endswith("ms"):
                value, scale = value[:-2], 1e-3
            elif value.endswith("s"):
                value = value[:-1]
            try:
                seconds = float(value) * scale
            except ValueError:
                seconds = -1.0
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"bad --slo {text!r}: {key} must be a positive duration")
            values[key] = seconds
        return cls(values["ttft"], values["tpot"])

    def scaled(self, factor: float) -> SLO:
        """Both targets times ``factor`` (DistServe's "SLO scale")."""
        return SLO(self.ttft_s * factor, self.tpot_s * factor)

    def __str__(self) -> str:
        return f"ttft<={self.ttft_s * 1e3:g}ms,tpot<={self.tpot_s * 1e3:g}ms"


@dataclass
class RunResult:
    label: str  # policy/queue[/swap]
    rate: float  # requests/s (inf: offline)
    model: str
    hardware: str
    tp: int
    arrival_s: np.ndarray
    first_token_s: np.ndarray  # NaN when the request never produced a token (ignored)
    finished_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray  # tokens actually generated
    priority: np.ndarray
    finish_reason: list[str]
    num_preemptions: int
    num_steps: int
    busy_s: float
    kv_usage_mean: float
    kv_usage_peak: float
    num_gpu_blocks: int
    block_size: int
    wall_s: float  # real seconds the simulation took
    config: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> np.ndarray:
        return self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = (self.finished_s - self.first_token_s) / (self.output_tokens - 1)
        return np.where(self.output_tokens > 1, tpot, np.nan)

    @property
    def makespan_s(self) -> float:
        if not len(self.arrival_s):
            return 0.0
        return float(np.nanmax(self.finished_s) - self.arrival_s.min())

    def meets(self, slo: SLO) -> np.ndarray:
        """Per request: served, and within both of ``slo``'s targets."""
        tpot = self.tpot_s
        with np.errstate(invalid="ignore"):
            return (~np.isnan(self.first_token_s) & (self.ttft_s <= slo.ttft_s)
                    & (np.isnan(tpot) | (tpot <= slo.tpot_s)))

    def summary(self, slo: SLO) -> dict:
        ttft, tpot, e2e = self.ttft_s, self.tpot_s, self.e2e_s
        served = ~np.isnan(self.first_token_s)
        span = self.makespan_s or math.nan
        good = self.meets(slo)
        out = {
            "label": self.label, "rate": self.rate, "model": self.model,
            "hardware": self.hardware, "tp": self.tp,
            "requests": len(self.arrival_s), "served": int(served.sum()),
            "ignored": self.finish_reason.count("ignored"),
            "makespan_s": span,
            "throughput_req_s": served.sum() / span,
            "output_tok_s": self.output_tokens.sum() / span,
            "total_tok_s": (self.output_tokens.sum() + self.prompt_tokens[served].sum()) / span,
            "preemptions": self.num_preemptions,
            "kv_usage_mean": self.kv_usage_mean, "kv_usage_peak": self.kv_usage_peak,
            "num_gpu_blocks": self.num_gpu_blocks,
            "slo": str(slo),
            "goodput_req_s": good.sum() / span,
            "slo_attainment": good.sum() / max(1, len(self.arrival_s)),
            "steps": self.num_steps, "wall_s": self.wall_s,
        }
        for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
            v = values[~np.isnan(values)]
            for p in (50, 90, 99):
                out[f"{name}_p{p}_ms"] = float(np.percentile(v, p)) * 1e3 if len(v) else math.nan
        return out
