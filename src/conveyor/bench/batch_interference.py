"""`conveyor bench batch`: how much a running batch job slows interactive requests.

One ``conveyor serve`` (the engine flags given; its own ``--batch-dir``) answers ``--requests``
streamed chat requests one after another on an idle server, then the same number while a
``--batch-size``-request batch (``/v1/batches``, chat completions of ``--batch-max-tokens``)
runs; ``--repeats`` rounds alternate the two. Reported: time to first token of each (min,
median, p90 over all rounds) and the ratio of the medians, busy to idle — the figure behind
"interactive requests' TTFT while a batch runs stays within 2x of an idle server's"."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from conveyor.bench.report import percentiles, write_result
from conveyor.bench.serving import engine_flags, spawned_server


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser("batch", help="interactive TTFT, idle vs while a batch job runs",
                              description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--requests", type=int, default=12,
                   help="interactive requests per round and state (default: 12)")
    p.add_argument("--batch-size", type=int, default=200,
                   help="requests in the batch job (default: 200)")
    p.add_argument("--batch-max-tokens", type=int, default=64,
                   help="max_tokens of each batch request (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--output", default=None, help="write the result JSON here")
    add_cli_args(p)
    p.set_defaults(func=run)


def _ttft(client: Any, model: str, i: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me one fact about the number {i}."}]}
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0]["delta"].get("content"):
                return time.perf_counter() - start
    return time.perf_counter() - start


def _start_batch(client: Any, model: str, n: int, max_tokens: int, round_: int) -> str:
    lines = [{"custom_id": f"r{round_}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Write a story about {i}."}]}}
             for i in range(n)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = client.post("/v1/files", files={"file": ("in.jsonl", data)},
                          data={"purpose": "batch"}).json()["id"]
    return client.post("/v1/batches", json={"input_file_id": file_id,
                                            "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"}).json()["id"]


def run(args: argparse.Namespace) -> int:
    import httpx

    idle: list[float] = []
    busy: list[float] = []
    with tempfile.TemporaryDirectory() as folder, \
            spawned_server(engine_flags(args) + ["--batch-dir", folder]) as base, \
            httpx.Client(base_url=base, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        _ttft(client, model, -1)  # warm-up
        for r in range(args.repeats):
            idle += [_ttft(client, model, i) for i in range(args.requests)]
            batch_id = _start_batch(client, model, args.batch_size, args.batch_max_tokens, r)
            while client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] < 1:
                time.sleep(0.1)
            busy += [_ttft(client, model, 1000 + i) for i in range(args.requests)]
            state = client.get(f"/v1/batches/{batch_id}").json()
            if state["status"] != "in_progress":
                print(f"round {r}: the batch was {state['status']} before the busy requests "
                      "ended; use a larger --batch-size")
            client.post(f"/v1/batches/{batch_id}/cancel")
            while client.get(f"/v1/batches/{batch_id}").json()["status"] not in (
                    "cancelled", "completed"):
                time.sleep(0.1)
    ratio = statistics.median(busy) / statistics.median(idle)
    result = {"idle_ttft_s": {"min": min(idle), **percentiles(idle)},
              "busy_ttft_s": {"min": min(busy), **percentiles(busy)},
              "ratio_median_busy_to_idle": ratio, "requests": args.requests,
              "repeats": args.repeats, "batch_size": args.batch_size,
              "batch_max_tokens": args.batch_max_tokens, "engine_flags": engine_flags(args)}
    print(f"TTFT idle: min {min(idle) * 1000:.0f} ms, median {statistics.median(idle) * 1000:.0f} ms;"
          f" while a batch runs: min {min(busy) * 1000:.0f} ms, median "
          f"{statistics.median(busy) * 1000:.0f} ms; ratio of medians {ratio:.2f}")
    if args.output:
        write_result(Path(args.output), result)
    return 0
