"""Runs the chat_multiturn workload (``chat_workload.py``) against a server: ``concurrency``
conversations at a time, each sending its turns in order (the next as soon as the previous
answer has streamed), a new conversation starting when one ends. Reports the serving summary
(TTFT, TPOT, ...) and, from the server's /metrics (every replica of a fleet summed), the
prefix-cache hit rate and the share of prompt tokens loaded from KV offload tiers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conveyor.bench.chat_workload import ChatWorkload
from conveyor.bench.serve_client import (
    RequestResult,
    ServeClient,
    metrics_prefix,
    preemptions_from_metrics,
    prefix_cache_from_metrics,
    summarize,
)


def offload_hits_from_metrics(text: str) -> float | None:
    """Prompt tokens loaded from a KV offload tier (every tier and replica summed)."""
    total, seen = 0.0, False
    prefix = metrics_prefix(text) + "kv_offload_hits_total"
    for line in text.splitlines():
        if line.startswith(prefix):
            total += float(line.rpartition(" ")[2])
            seen = True
    return total if seen else None


async def run_chat(client: ServeClient, workload: ChatWorkload, concurrency: int,
                   slo: dict[str, float], duration_limit: float | None = None) -> dict[str, Any]:
    if concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 for chat_multiturn, got {concurrency}")
    await client.model_name()
    before = await client.metrics_text()
    queue = list(range(len(workload.conversations)))[::-1]
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def worker() -> None:
        while queue:
            conv = workload.conversations[queue.pop()]
            for k, turn in enumerate(conv.turns):
                if duration_limit is not None and time.perf_counter() - start > duration_limit:
                    return
                result = await client.complete(conv.prompt(k), len(turn.reply))
                results.append(result)
                if not result.ok:
                    break  # the rest of this conversation would build on a missing answer

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - start
    after = await client.metrics_text()
    summary = summarize(results, duration, slo)
    summary.update(request_rate=float("inf"), burstiness=1.0, max_concurrency=concurrency,
                   preemptions=None, conversations=len(workload.conversations))
    if before is not None and after is not None:
        p0, p1 = preemptions_from_metrics(before), preemptions_from_metrics(after)
        summary["preemptions"] = None if p0 is None or p1 is None else int(p1 - p0)
        c0, c1 = prefix_cache_from_metrics(before), prefix_cache_from_metrics(after)
        if c0 is not None and c1 is not None and c1[1] > c0[1]:
            queries = c1[1] - c0[1]
            summary["prefix_hit_rate"] = (c1[0] - c0[0]) / queries
            o0, o1 = offload_hits_from_metrics(before), offload_hits_from_metrics(after)
            if o0 is not None and o1 is not None:
                summary["offload_hit_rate"] = (o1 - o0) / queries
    return summary
