"""The serving benchmarks' client side: ``ServeClient`` streams completions (or embeddings) from
one OpenAI-compatible server on loopback and times them (``RequestResult``); ``summarize`` turns
the results into the reported latencies and throughputs; the ``*_from_metrics`` readers take
counters off the server's Prometheus page (every replica of a fleet summed).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.report import percentiles

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    send_time: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def metrics_prefix(text: str) -> str:
    """``conveyor:``, or ``vllm:`` on a page of vLLM's server (``bench serve --compare vllm``)."""
    names = {line.split(":", 1)[0] for line in text.splitlines() if not line.startswith("#")}
    return "vllm:" if "vllm" in names and "conveyor" not in names else "conveyor:"


def preemptions_from_metrics(text: str) -> float | None:
    """Sum of the server's counters about preemption in a Prometheus text page."""
    total, seen = 0.0, False
    prefix = metrics_prefix(text)
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if "preempt" in metric and metric.endswith("_total"):  # counters, not histograms
            total += float(value)
            seen = True
    return total if seen else None


def prefix_cache_from_metrics(text: str) -> tuple[float, float] | None:
    """(hits, queries) of the prefix cache, summed over every replica of a Prometheus page."""
    hits = queries = 0.0
    seen = False
    prefix = metrics_prefix(text)
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0].removeprefix(prefix)
        if metric == "prefix_cache_hits_total":
            hits += float(value)
            seen = True
        elif metric == "prefix_cache_queries_total":
            queries += float(value)
    return (hits, queries) if seen else None


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if r.ttft <= slo.get("ttft", math.inf)
            and (r.output_tokens < 2 or r.tpot <= slo.get("tpot", math.inf))
            and r.e2e <= slo.get("e2e", math.inf)]
    duration = max(duration, 1e-9)
    return {
        "sent": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "goodput": len(good) / duration,
        "slo": slo,
        "ttft": percentiles([r.ttft for r in done]),
        "tpot": percentiles([r.tpot for r in done if not math.isnan(r.tpot)]),
        "itl": percentiles([x for r in done for x in r.itl]),
        "e2e": percentiles([r.e2e for r in done]),
    }


class ServeClient:
    """Streams completions from one server; one instance per benchmark run."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        import httpx

        host = httpx.URL(base_url).host
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"--base-url must be a loopback address, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self.model: str | None = None

    async def close(self) -> None:
        await self.client.aclose()

    async def model_name(self) -> str:
        if self.model is None:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def metrics_text(self) -> str | None:
        try:
            r = await self.client.get("/metrics")
        except Exception:
            return None
        return r.text if r.status_code == 200 else None

    async def metrics_preemptions(self) -> float | None:
        text = await self.metrics_text()
        return None if text is None else preemptions_from_metrics(text)

    async def send(self, request: Any) -> RequestResult:
        """A text is an embedding request; a workload request a streamed completion."""
        if isinstance(request, str):
            return await self.embed(request)
        return await self.complete(request.prompt_token_ids, request.max_tokens)

    async def embed(self, text: str) -> RequestResult:
        body = {"model": await self.model_name(), "input": text, "encoding_format": "base64"}
        result = RequestResult(ok=False, prompt_tokens=0)
        start = result.send_time = time.perf_counter()
        try:
            resp = await self.client.post("/v1/embeddings", json=body)
        except Exception as e:  # a failed request is counted, never fatal to the run
            result.error = f"{type(e).__name__}: {e}"[:200]
            return result
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return result
        result.e2e = result.ttft = time.perf_counter() - start
        result.prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        result.ok = True
        return result

    async def complete(self, prompt: list[int], max_tokens: int) -> RequestResult:
        body = {"model": await self.model_name(), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        result = RequestResult(ok=False, prompt_tokens=len(prompt))
        start = result.send_time = time.perf_counter()
        last = None
        chunks = 0
        usage_tokens = None
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    if not chunk.get("choices"):
                        continue
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        except Exception as e:  # a failed request is counted, never fatal to the run
            result.error = f"{type(e).__name__}: {e}"[:200]
            return result
        result.e2e = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = last is not None
        if not result.ok:
            result.error = "no tokens streamed"
        return result
