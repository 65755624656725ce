"""Workloads for the simulator: when requests arrive, how long their prompts and outputs are.

* Arrivals at ``rate`` requests/s: ``poisson`` (exponential gaps) or ``gamma:CV`` (gamma gaps
  with coefficient of variation CV: > 1 burstier than Poisson, < 1 smoother); ``rate=inf``
  puts every request at t=0 (offline batch).
* Lengths: ``fixed:N`` (or just ``N``), ``uniform:A-B`` (inclusive), ``lognormal:mean=M,sigma=S``
  (optionally ``,min=..,max=..``; M is the mean before clipping), or the presets
  ``chat-input`` / ``chat-output``: log-normals whose means match the ShareGPT statistics the
  vLLM paper reports (161 prompt / 338 output tokens on average); their sigmas (1.0, 0.8) are our
  choice for a long right tail, not a fit to raw traces. Clipped to [1, 8192] / [1, 2048].
* Priorities: ``0`` (all equal), ``0,1,2`` (uniform) or ``0:0.2,1:0.8`` (weighted).
* Traces: JSONL, one request per line: ``{"arrival_s": 0.1, "prompt_tokens": 200,
  "output_tokens": 64, "priority": 0}`` (priority optional).

Everything draws from ``numpy.random.default_rng(seed)``: one seed, one workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PRESETS = {
    "chat-input": "lognormal:mean=161,sigma=1.0,min=1,max=8192",
    "chat-output": "lognormal:mean=338,sigma=0.8,min=1,max=2048",
}


@dataclass
class Workload:
    """Requests sorted by arrival; parallel arrays, one entry per request."""

    arrival_s: np.ndarray  # float64 seconds
    prompt_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    priority: np.ndarray  # int64, lower runs first under --queue priority
    name: str = ""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == len(self.priority) == n):
            raise ValueError("workload arrays must all have one entry per request")
        if n and (np.any(self.prompt_tokens < 1) or np.any(self.output_tokens < 1)):
            raise ValueError("workload prompt_tokens and output_tokens must be >= 1")
        if n and (np.any(self.arrival_s < 0) or np.any(np.diff(self.arrival_s) < 0)):
            raise ValueError("workload arrival_s must be >= 0 and sorted")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def save_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for a, p, o, q in zip(self.arrival_s.tolist(), self.prompt_tokens.tolist(),
                                  self.output_tokens.tolist(), self.priority.tolist(), strict=False):
                f.write(json.dumps({"arrival_s": a, "prompt_tokens": p,
                                    "output_tokens": o, "priority": q}) + "\n")


# -- lengths ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    low: int = 1
    high: int = 1
    mean: float = 0.0
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str = "length") -> LengthDist:
        text = PRESETS.get(text.strip(), text.strip())
        kind, _, rest = text.partition(":")
        if not rest and kind.isdigit():
            kind, rest = "fixed", kind
        try:
            if kind == "fixed":
                n = int(rest)
                dist = cls("fixed", n, n)
            elif kind == "uniform":
                lo, _, hi = rest.partition("-")
                dist = cls("uniform", int(lo), int(hi))
            elif kind == "lognormal":
                opts = dict(part.split("=", 1) for part in rest.split(","))
                unknown = set(opts) - {"mean", "sigma", "min", "max"}
                if unknown or not {"mean", "sigma"} <= set(opts):
                    raise ValueError
                dist = cls("lognormal", int(opts.get("min", 1)), int(opts.get("max", 1 << 20)),
                           float(opts["mean"]), float(opts["sigma"]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad {what} distribution {text!r}: use fixed:N, uniform:A-B, "
                f"lognormal:mean=M,sigma=S[,min=A,max=B], or {', '.join(PRESETS)}") from None
        if dist.low < 1 or dist.high < dist.low:
            raise ValueError(f"bad {what} distribution {text!r}: lengths must satisfy 1 <= low <= high")
        if kind == "lognormal" and not (dist.mean >= 1 and 0 <= dist.sigma <= 4):
            raise ValueError(f"bad {what} distribution {text!r}: need mean >= 1 and 0 <= sigma <= 4")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[X] = mean
        x = np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        return np.clip(x, self.low, self.high)


# -- arrivals --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArrivalProcess:
    kind: str  # poisson | gamma
    cv: float = 1.0

    @classmethod
    def parse(cls, text: str) -> ArrivalProcess:
        kind, _, rest = text.strip().partition(":")
        if kind == "poisson" and not rest:
            return cls("poisson")
        if kind == "gamma":
            try:
                cv = float(rest)
            except ValueError:
                cv = -1.0
            if cv > 0 and math.isfinite(cv):
                return cls("gamma", cv)
        raise ValueError(f"bad arrival process {text!r}: use poisson or gamma:CV (CV > 0)")

    def sample(self, rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
        if rate == math.inf:
            return np.zeros(n)
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate!r}")
        if self.kind == "poisson":
            gaps = rng.exponential(1.0 / rate, size=n)
        else:
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
        return np.cumsum(gaps) - gaps[0] if n else gaps  # first request at t=0


def parse_priorities(text: str) -> tuple[np.ndarray, np.ndarray]:
    """``0,1,2`` or ``0:0.2,1:0.8`` -> (values, probabilities)."""
    values, weights = [], []
    try:
        for part in text.split(","):
            v, _, w = part.partition(":")
            values.append(int(v))
            weights.append(float(w) if w else 1.0)
    except ValueError:
        raise ValueError(f"bad priorities {text!r}: use 0,1,2 or 0:0.2,1:0.8") from None
    w = np.array(weights)
    if np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"bad priorities {text!r}: weights must be >= 0 and not all 0")
    return np.array(values, dtype=np.int64), w / w.sum()


def generate(num_requests: int, rate: float, input_len: str = "chat-input",
             output_len: str = "chat-output", arrival: str = "poisson", priorities: str = "0",
             seed: int = 0) -> Workload:
    """A seeded synthetic workload (see the module docstring for the spec strings)."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    inputs = LengthDist.parse(input_len, "input length")
    outputs = LengthDist.parse(output_len, "output length")
    process = ArrivalProcess.parse(arrival)
    values, probs = parse_priorities(priorities)
    rng = np.random.default_rng(seed)
    arrival_s = process.sample(rng, num_requests, rate)
    prompt = inputs.sample(rng, num_requests)
    output = outputs.sample(rng, num_requests)
    prio = values[rng.choice(len(values), size=num_requests, p=probs)] if len(values) > 1 \
        else np.full(num_requests, values[0], dtype=np.int64)
    name = f"{arrival}@{rate:g}/s in={input_len} out={output_len} n={num_requests} seed={seed}"
    return Workload(arrival_s, prompt, output, prio, name)


def load_trace(path: str | Path) -> Workload:
    """Read a JSONL trace; requests are sorted by arrival. ValueError names the bad line."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            unknown = set(rec) - {"arrival_s", "prompt_tokens", "output_tokens", "priority"}
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown field(s) {', '.join(sorted(unknown))}")
            for key in ("arrival_s", "prompt_tokens", "output_tokens"):
                if key not in rec:
                    raise ValueError(f"{path}:{lineno}: missing field {key}")
            a, p, o, q = rec["arrival_s"], rec["prompt_tokens"], rec["output_tokens"], rec.get("priority", 0)
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0 <= a < math.inf):
                raise ValueError(f"{path}:{lineno}: arrival_s must be a number >= 0, got {a!r}")
            for key, v in (("prompt_tokens", p), ("output_tokens", o)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{path}:{lineno}: {key} must be an integer >= 1, got {v!r}")
            if isinstance(q, bool) or not isinstance(q, int):
                raise ValueError(f"{path}:{lineno}: priority must be an integer, got {q!r}")
            rows.append((float(a), p, o, q))
    if not rows:
        raise ValueError(f"{path}: trace has no requests")
    rows.sort(key=lambda r: r[0])
    a, p, o, q = (np.array(col) for col in zip(*rows, strict=False))
    return Workload(a.astype(np.float64), p.astype(np.int64), o.astype(np.int64),
                    q.astype(np.int64), name=f"trace {Path(path).name}")
