"""What every peer driver shares (``vllm_driver.py``, ``llamacpp_driver.py``): reading the request,
the warm-up and timed repeats, one repeat's figures, writing the result.

A driver runs as ``python DRIVER.py REQUEST.json RESULT.json`` with the Python of the peer's own
environment (``peer_env.PeerEnv.run_driver``), where Conveyor is not installed: this file, like
the drivers, imports only the standard library, and a driver imports it as the module beside it
(the script's folder is first on ``sys.path``), or as ``conveyor.bench.peer_driver`` when
imported inside Conveyor (the tests).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def measurement(wall_s: float, requests: list[dict], outputs: list[list[int]] | list[int],
                token_times: list[float] | None = None, start: float = 0.0) -> dict[str, Any]:
    """One repeat's figures. ``outputs``: each request's generated token ids (or their count);
    ``token_times`` (single stream): each new token's timestamp, ``start`` the request's."""
    m: dict[str, Any] = {
        "wall_s": wall_s,
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": sum(o if isinstance(o, int) else len(o) for o in outputs)}
    if token_times:
        n = len(token_times)
        m["ttft_s"] = token_times[0] - start
        span = token_times[-1] - token_times[0]
        m["decode_tokens_per_s"] = (n - 1) / span if n > 1 and span > 0 else None
    return m


def timed_repeats(job: dict[str, Any], run_batch: Callable[[list[dict]], dict],
                  run_single: Callable[[dict], dict]) -> list[dict[str, Any]]:
    """The warm-up, untimed, then every repeat's requests: one stream (``run_single`` with the
    repeat's one request) or a batch (``run_batch``)."""
    def run_once(requests: list[dict]) -> dict:
        return run_single(requests[0]) if job["single_stream"] else run_batch(requests)

    run_once(job["warmup"])
    return [run_once(requests) for requests in job["repeats"]]


def timed_single_stream(generate: Callable[[Callable[[], None]], Any],
                        request: dict) -> dict[str, Any]:
    """One request through ``generate(on_token)``, which calls ``on_token()`` as each new token
    arrives: time to first token and decode rate from those timestamps."""
    times: list[float] = []
    t0 = time.perf_counter()
    generate(lambda: times.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    return measurement(wall, [request], [len(times)], times, t0)


def driver_main(argv: list[str], run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """``argv``: the script, REQUEST.json, RESULT.json; writes ``run(request)`` as the result."""
    if len(argv) != 3:
        raise SystemExit(f"usage: python {argv[0]} REQUEST.json RESULT.json")
    with open(argv[1]) as f:
        job = json.load(f)
    result = run(job)
    with open(argv[2], "w") as f:
        json.dump(result, f, indent=2)
    return 0
