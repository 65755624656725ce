"""`conveyor bench soak`: a server under a long, mixed, partly hostile load.

First a short burst finds the server's saturation throughput (requests/s with every request
sent at once); then, for ``--duration`` seconds, requests arrive as a Poisson process at
``--load`` (default 0.8) of it. Most are ordinary streamed completions; mixed in at
``--hostile`` (default 0.25) of arrivals: clients that disconnect mid-stream, prompts over the
size limit, malformed or wrongly typed bodies, non-JSON bodies, ``n`` over the limit. Every
``--sample-every`` seconds the server's RSS and KV-cache usage are sampled.

It passes when: no answer was a 5xx (nor a dropped connection the client did not cause), every
hostile request got the 4xx it deserved, the KV cache is empty once the load stops (no leaked
blocks), and the RSS at the end is within ``--rss-tolerance`` of the RSS after the first
minute. Latency percentiles of the ordinary requests are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.report import percentiles, write_result
from conveyor.bench.serving import engine_flags, spawned_server

KINDS = ("ok", "disconnect", "oversize", "bad_json", "bad_type", "not_json", "too_many_n")
EXPECTED = {"oversize": {400}, "bad_json": {400}, "bad_type": {400}, "not_json": {415},
            "too_many_n": {400}}


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: the connection failed
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _body(kind: str, rng: random.Random, max_tokens: int, oversize_chars: int) -> tuple[Any, str]:
    """(request body, content type) for one arrival of ``kind``."""
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "sea", "story"])
                      for _ in range(rng.randint(4, 40)))
    body: Any = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                 "ignore_eos": True, "stream": True}
    content_type = "application/json"
    if kind == "oversize":
        body = {"prompt": "z" * oversize_chars, "max_tokens": 4}
    elif kind == "bad_json":
        body = '{"prompt": "unterminated'
    elif kind == "bad_type":
        body = {"prompt": "Hi", "max_tokens": rng.choice(["5", -3, [1], {"x": 1}])}
    elif kind == "not_json":
        content_type = "text/plain"
    elif kind == "too_many_n":
        body = {"prompt": "Hi", "max_tokens": 1, "n": 100_000}
    return body, content_type


async def _one(client: Any, kind: str, body: Any, content_type: str,
               rng: random.Random) -> Outcome:
    raw = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": content_type}
    out = Outcome(kind, None)
    start = time.perf_counter()
    stop_after = rng.randint(1, 8) if kind == "disconnect" else None
    try:
        async with client.stream("POST", "/v1/completions", content=raw,
                                 headers=headers) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                out.error = resp.text[:200]
                return out
            last = None
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"error"' in line:
                    out.error = line[:200]
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return out  # leaving the block closes the connection mid-stream
            out.e2e = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - counted as a failure
        out.error = f"{type(e).__name__}: {e}"[:200]
    return out


def _server_pid(base_url: str) -> int | None:
    """The pid of the ``conveyor serve`` listening on ``base_url``'s port (this machine)."""
    port = base_url.rsplit(":", 1)[-1]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and port.encode() in argv:
            return int(pid)
    return None


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _metric(client: Any, name: str) -> float | None:
    try:
        text = (await client.get("/metrics")).text
    except Exception:  # noqa: BLE001
        return None
    for line in text.splitlines():
        if line.startswith(f"conveyor:{name}"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _saturation(client: Any, n: int, max_tokens: int, rng: random.Random) -> float:
    """Completed ordinary requests per second with ``n`` sent at once."""
    start = time.perf_counter()
    outs = await asyncio.gather(*(_one(client, "ok", *_body("ok", rng, max_tokens, 0), rng)
                                  for _ in range(n)))
    ok = sum(o.status == 200 and not o.error for o in outs)
    return ok / (time.perf_counter() - start)


async def soak(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        context = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        oversize_chars = context * 100 + 1  # beyond any tokenizer's longest entry
        pid = _server_pid(base_url)
        saturation = args.rate / args.load if args.rate else await _saturation(
            client, args.saturation_requests, args.max_tokens, rng)
        rate = args.load * saturation
        print(f"saturation {saturation:.2f} req/s; soaking at {rate:.2f} req/s for "
              f"{args.duration:.0f} s", file=sys.stderr)
        samples: list[dict[str, float | None]] = []
        tasks: list[asyncio.Task[Outcome]] = []
        start = time.perf_counter()
        next_sample = start
        t = start
        while t - start < args.duration:
            t += rng.expovariate(rate)
            while next_sample <= min(t, start + args.duration):
                await asyncio.sleep(max(0.0, next_sample - time.perf_counter()))
                samples.append({"t": time.perf_counter() - start, "rss_mib": _rss_mib(pid),
                                "kv_usage": await _metric(client, "kv_cache_usage_perc"),
                                "running": await _metric(client, "num_requests_running")})
                next_sample += args.sample_every
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            if time.perf_counter() - start >= args.duration:
                break
            kind = "ok" if rng.random() >= args.hostile else rng.choice(KINDS[1:])
            body, content_type = _body(kind, rng, args.max_tokens, oversize_chars)
            tasks.append(asyncio.create_task(_one(client, kind, body, content_type, rng)))
        outcomes = await asyncio.gather(*tasks)
        for _ in range(600):  # the load has stopped: wait for the engine to go idle
            if await _metric(client, "num_requests_running") == 0:
                break
            await asyncio.sleep(0.5)
        end_kv = await _metric(client, "kv_cache_usage_perc")
        end_rss = _rss_mib(pid)
    return _report(outcomes, samples, end_kv, end_rss, saturation, rate, args)


def _report(outcomes: list[Outcome], samples: list[dict[str, Any]], end_kv: float | None,
            end_rss: float | None, saturation: float, rate: float,
            args: argparse.Namespace) -> dict[str, Any]:
    by_kind = {k: Counter(str(o.status) for o in outcomes if o.kind == k) for k in KINDS}
    server_errors = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    dropped = [o.error for o in outcomes if o.status is None]
    wrong = [(o.kind, o.status) for o in outcomes
             if o.kind in EXPECTED and o.status not in EXPECTED[o.kind]]
    ok = [o for o in outcomes if o.kind == "ok"]
    failed_ok = [o.error or str(o.status) for o in ok if o.status != 200 or o.error]
    rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    warm = [s["rss_mib"] for s in samples if s["rss_mib"] is not None and s["t"] >= 60]
    baseline = warm[0] if warm else (rss[len(rss) // 2] if rss else None)
    growth = None if baseline is None or end_rss is None else end_rss / baseline - 1
    summary = {
        "duration_s": args.duration, "saturation_rps": saturation, "rate_rps": rate,
        "requests": len(outcomes), "by_kind": {k: dict(v) for k, v in by_kind.items() if v},
        "server_errors_5xx": server_errors, "dropped_connections": len(dropped),
        "wrong_status": wrong[:20], "failed_ordinary": failed_ok[:20],
        "kv_usage_at_end": end_kv, "rss_mib_baseline": baseline, "rss_mib_end": end_rss,
        "rss_growth": growth, "samples": samples,
        "ttft_s": percentiles([o.ttft for o in ok if not math.isnan(o.ttft)]),
        "e2e_s": percentiles([o.e2e for o in ok if not math.isnan(o.e2e)]),
        "itl_s": percentiles([x for o in ok for x in o.itl]),
    }
    summary["passed"] = (server_errors == 0 and not dropped and not wrong and not failed_ok
                         and end_kv == 0.0
                         and (growth is None or growth <= args.rss_tolerance))
    return summary


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_soak(summary: dict[str, Any]) -> str:
    """The summary as the bench prints it: counts by kind, errors, KV cache, RSS, latencies."""

    def ms(p: dict[str, float]) -> str:
        return " / ".join(f"{p[k] * 1000:.0f}" if k in p else "-" for k in ("p50", "p90", "p99"))

    growth = summary["rss_growth"]
    return "\n".join([
        f"requests {summary['requests']} at {summary['rate_rps']:.2f} req/s "
        f"(saturation {summary['saturation_rps']:.2f}) for {summary['duration_s']:.0f} s",
        *(f"  {kind:<11} {dict(counts)}" for kind, counts in summary["by_kind"].items()),
        f"5xx: {summary['server_errors_5xx']}   dropped: {summary['dropped_connections']}   "
        f"wrong status: {len(summary['wrong_status'])}   failed ordinary: "
        f"{len(summary['failed_ordinary'])}",
        f"KV cache usage after the load: {summary['kv_usage_at_end']}",
        f"RSS MiB: baseline {_mib(summary['rss_mib_baseline'])}, end "
        f"{_mib(summary['rss_mib_end'])}, "
        f"growth {'-' if growth is None else f'{growth * 100:+.1f}%'}",
        f"ordinary requests, ms p50 / p90 / p99: TTFT {ms(summary['ttft_s'])}; "
        f"e2e {ms(summary['e2e_s'])}; ITL {ms(summary['itl_s'])}",
        "PASSED" if summary["passed"] else "FAILED",
    ])


def main(args: argparse.Namespace) -> int:
    if bool(args.spawn) == bool(args.base_url):
        raise SystemExit("bench soak: give exactly one of --base-url URL or --spawn")
    if args.spawn:
        with spawned_server(engine_flags(args), log_path=args.server_log) as base:
            summary = asyncio.run(soak(base, args))
    else:
        summary = asyncio.run(soak(args.base_url, args))
    print(format_soak(summary))
    if args.json:
        write_result(args.json, summary)
    return 0 if summary["passed"] else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser("soak", help="long mixed load with hostile requests: 5xx, "
                              "leaked KV blocks, RSS, latency",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--base-url", default=None, help="a running server (loopback)")
    p.add_argument("--spawn", action="store_true", help="start `conveyor serve` itself")
    p.add_argument("--server-log", default=None, help="with --spawn: write its output here")
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of load (default: 600)")
    p.add_argument("--load", type=float, default=0.8,
                   help="fraction of the saturation throughput to send (default: 0.8)")
    p.add_argument("--rate", type=float, default=None,
                   help="the saturation throughput in req/s, if known (default: measured)")
    p.add_argument("--saturation-requests", type=int, default=32,
                   help="requests sent at once to measure saturation (default: 32)")
    p.add_argument("--hostile", type=float, default=0.25,
                   help="fraction of arrivals that disconnect or are bad (default: 0.25)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens per ordinary request (default: 32)")
    p.add_argument("--sample-every", type=float, default=10.0,
                   help="seconds between RSS / KV samples (default: 10)")
    p.add_argument("--rss-tolerance", type=float, default=0.1,
                   help="largest RSS growth after the first minute that passes (default: 0.1)")
    p.add_argument("--json", default=None, help="write the summary here")
    add_cli_args(p)
    p.set_defaults(func=main)
