"""`conveyor bench serve`: a seeded stream of requests against an OpenAI-compatible server.

Requests arrive as a Poisson process (``--burstiness 1``) or a gamma process (other values:
below 1 burstier, above 1 steadier) at each ``--request-rate`` of a sweep, at most
``--max-concurrency`` in flight, bounded by ``--num-prompts`` and ``--duration``. Each request
streams from ``/v1/completions`` over loopback; the client timestamps every chunk and reports
TTFT, TPOT, ITL and end-to-end latency, throughput, goodput under ``--slo``, and the
preemptions the server's ``/metrics`` counted. ``--spawn`` starts ``conveyor serve`` itself.
``--endpoint embeddings`` sends the prompts as text to ``/v1/embeddings`` instead
(``bench/embeddings.py``). ``--workload chat_multiturn`` runs multi-turn conversations instead,
``--max-concurrency`` of them at a time (``bench/chat_workload.py``, ``bench/chat_run.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

from conveyor.bench.embeddings import (
    EMBEDDING_PEERS,
    format_embedding_table,
    run_sentence_transformers,
    workload_texts,
)
from conveyor.bench.provenance import peer_versions
from conveyor.bench.report import (
    format_serving_table,
    plot_serving,
    write_result,
)
from conveyor.bench.serve_client import (
    RequestResult,
    ServeClient,
    preemptions_from_metrics,
    prefix_cache_from_metrics,
    summarize,
)
from conveyor.bench.workloads import SPECS, make_workload


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` requests: gamma inter-arrivals with mean
    1/rate and shape ``burstiness`` (1 = Poisson); all at 0 when the rate is infinite."""
    if rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=0.5,tpot=0.1"`` (seconds) -> {"ttft": 0.5, "tpot": 0.1}; keys ttft, tpot, e2e."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--slo: expected ttft=SECONDS,tpot=SECONDS,e2e=SECONDS, got {part!r}")
        slo[key] = float(value)
    return slo


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip().lower() == "inf" else float(r) for r in text.split(",")]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rate: positive numbers or inf, got {text!r}")
    return rates


async def run_rate(client: ServeClient, requests: list, rate: float, burstiness: float,
                   max_concurrency: int | None, duration_limit: float | None, seed: int,
                   slo: dict[str, float]) -> dict[str, Any]:
    """Send ``requests`` at ``rate`` and summarize; stops sending after ``duration_limit``."""
    await client.model_name()
    before_text = await client.metrics_text()
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(req, offset: float) -> RequestResult | None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if duration_limit is not None and time.perf_counter() - start > duration_limit:
            return None
        if gate is None:
            return await client.send(req)
        async with gate:
            return await client.send(req)

    results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    sent = [r for r in results if r is not None]
    duration = time.perf_counter() - start
    after_text = await client.metrics_text()
    summary = summarize(sent, duration, slo)
    before = after = None
    if before_text is not None and after_text is not None:
        before, after = preemptions_from_metrics(before_text), preemptions_from_metrics(after_text)
        cache0, cache1 = (prefix_cache_from_metrics(before_text),
                          prefix_cache_from_metrics(after_text))
        if cache0 is not None and cache1 is not None and cache1[1] > cache0[1]:
            summary["prefix_hit_rate"] = (cache1[0] - cache0[0]) / (cache1[1] - cache0[1])
    summary["request_rate"] = rate
    summary["burstiness"] = burstiness
    summary["max_concurrency"] = max_concurrency
    summary["preemptions"] = (None if before is None or after is None
                              else int(after - before))
    return summary


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line that differ from the defaults, as argv; the
    scheduling flags always (`conveyor serve` has defaults of its own), so that the server runs
    the policy this command reports."""
    from conveyor.engine.args import SERVE_RESOLVED, EngineArgs, from_cli_args

    given, defaults = from_cli_args(args), EngineArgs()
    argv: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(given, f.name)
        if value == getattr(defaults, f.name) and f.name not in SERVE_RESOLVED:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


@contextlib.contextmanager
def spawned_server(extra_argv: list[str], ready_timeout: float = 600.0,
                   log_path: str | None = None) -> Iterator[str]:
    """Start ``conveyor serve`` on a free loopback port; yield its base URL; stop it."""
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *extra_argv]
    with serving_process(cmd, port, "conveyor serve", ready_timeout, log_path) as base:
        yield base


@contextlib.contextmanager
def serving_process(cmd: list[str], port: int, name: str, ready_timeout: float = 600.0,
                    log_path: str | None = None,
                    env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``cmd``, a server on 127.0.0.1:``port``; yield its base URL once ``/v1/models``
    answers; stop it."""
    import httpx

    # without a log path the output goes to a temporary file, read for the cause if it fails
    log = (open(log_path, "w") if log_path  # noqa: SIM115
           else tempfile.TemporaryFile("w+", errors="replace"))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                cause = "" if log_path else f" ({_server_error(log)})"
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was "
                                   f"ready{cause}: {' '.join(cmd)}")
            try:
                if httpx.get(base + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {ready_timeout:.0f}s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# Ray Serve's errors that wrap a replica's own rather than say it
_SERVE_WRAPPERS = ("Traceback (most recent call last)", "Deploying application")


def _server_error(log: IO[str]) -> str:
    """The root cause in a server's output so far (``log``: the file it writes to)."""
    from conveyor.bench.peer_env import root_cause

    log.flush()
    log.seek(0)
    return root_cause(log.read(), _SERVE_WRAPPERS)


CHAT_WORKLOAD = "chat_multiturn"
CHAT_CONCURRENCY = 6  # conversations at a time when --max-concurrency is not given


async def run_chat_workload(base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from conveyor.bench.chat_run import run_chat
    from conveyor.bench.chat_workload import make_chat_workload, parse_chat_spec

    workload = make_chat_workload(args.vocab_size, args.seed, parse_chat_spec(args.chat_spec),
                                  num_conversations=args.num_conversations)
    print(f"[bench] {workload.describe(args.block_size, args.num_gpu_blocks)}", file=sys.stderr,
          flush=True)
    client = ServeClient(base_url, timeout=args.request_timeout)
    try:
        summary = await run_chat(client, workload, args.max_concurrency or CHAT_CONCURRENCY,
                                 parse_slo(args.slo), args.duration)
    finally:
        await client.close()
    summary.update(label=args.label, workload=workload.name,
                   working_set_blocks=workload.working_set_blocks(args.block_size))
    print(format_serving_table([summary]).splitlines()[-1], flush=True)
    return [summary]


async def run_sweep(base_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.workload == CHAT_WORKLOAD:
        return await run_chat_workload(base_url, args)
    workload = make_workload(args.workload, args.vocab_size, args.seed, args.num_prompts)
    if args.output_len is not None:
        workload = dataclasses.replace(workload, requests=[
            dataclasses.replace(r, max_tokens=args.output_len) for r in workload.requests])
    slo = parse_slo(args.slo)
    requests: list[Any] = workload.requests
    if args.endpoint == "embeddings":
        requests = workload_texts([r.prompt_token_ids for r in requests], args.model)
    client = ServeClient(base_url, timeout=args.request_timeout)
    runs = []
    try:
        for rate in parse_rates(args.request_rate):
            summary = await run_rate(client, requests, rate, args.burstiness,
                                     args.max_concurrency, args.duration, args.seed, slo)
            summary["label"] = args.label
            summary["workload"] = workload.name
            runs.append(summary)
            print(_table(args, [summary]).splitlines()[-1], flush=True)
    finally:
        await client.close()
    return runs


def spawn_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, extra `conveyor serve` flags) per server to spawn: one, or one per --router of a
    --data-parallel-size fleet, each once per --pd-variants shape and per --kv-offload-variants
    size, measured one after the other in this run."""
    offloads = parse_offload_variants(args.kv_offload_variants)
    shapes = parse_pd_variants(getattr(args, "pd_variants", None))
    if args.data_parallel_size <= 1 and not args.router and not shapes:
        servers = [(args.label, [])]
    else:
        common = ["--threads-per-replica", str(args.threads_per_replica)]
        if args.ray_num_cpus is not None:
            common += ["--ray-num-cpus", str(args.ray_num_cpus)]
        routers = [r.strip() for r in (args.router or "prefix_affinity").split(",") if r.strip()]
        fleets = []
        for shape in shapes or [None]:
            if shape is None:
                fleets.append((f"dp{args.data_parallel_size}",
                               ["--data-parallel-size", str(args.data_parallel_size)]))
            else:
                p, d = shape
                fleets.append((f"pd{p}:{d}", ["--data-parallel-size", str(p + d),
                                              "--pd", f"{p}:{d}"]))
        servers = [(f"{args.label} {name} {r}", flags + common + ["--router", r])
                   for name, flags in fleets for r in routers]
    if not offloads:
        return servers
    return [(f"{label} offload={'off' if n == 0 else n}",
             flags + ["--kv-offload-cpu-bytes", str(n)])
            for label, flags in servers for n in offloads]


def parse_pd_variants(text: str | None) -> list[tuple[int, int] | None]:
    """``"off,1:1"`` -> [None, (1, 1)]: a plain --data-parallel-size fleet, then a prefill/decode
    one."""
    from conveyor.routing.pd_split import parse_pd

    if not text:
        return []
    return [None if t.strip() == "off" else parse_pd(t) for t in text.split(",") if t.strip()]


def parse_offload_variants(text: str | None) -> list[int]:
    """``"0,268435456"`` -> [0, 268435456] (bytes of host memory for KV offload; 0: off)."""
    if not text:
        return []
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--kv-offload-variants: comma-separated byte counts, got {text!r}"
                         ) from None
    if not sizes or any(n < 0 for n in sizes):
        raise ValueError(f"--kv-offload-variants: byte counts >= 0, got {text!r}")
    return sizes


def _with_label(args: argparse.Namespace, label: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "label": label})


SERVING_PEERS = ("vllm",)


def _table(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    if getattr(args, "endpoint", "completions") == "embeddings":
        return format_embedding_table(runs)
    return format_serving_table(runs)


def compare_peers(args: argparse.Namespace) -> list[str]:
    names = [c.strip() for c in (args.compare or "").split(",") if c.strip()]
    known = EMBEDDING_PEERS if args.endpoint == "embeddings" else SERVING_PEERS
    for name in names:
        if name not in known:
            raise SystemExit(f"bench serve: --compare: unknown peer {name!r} for --endpoint "
                             f"{args.endpoint}; known: {', '.join(known)}")
    if names and not args.spawn:
        raise SystemExit("bench serve: --compare needs --spawn (the bench starts both servers)")
    return names


def run_vllm_sweep(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The same sweep against vLLM's OpenAI server, started on a free loopback port with the
    same model, dtype, ``max_num_seqs`` and prefix caching; (runs, what ran or why not)."""
    import tempfile

    import httpx

    from conveyor.bench import peers_vllm
    from conveyor.engine.args import from_cli_args
    from conveyor.model.device import dtype_name, resolve_device, resolve_dtype
    from conveyor.model.loader import model_path

    ea = from_cli_args(args)
    device = resolve_device(ea.device)
    reason = peers_vllm.cpu_only_reason(device.type) or peers_vllm.skip_reason()
    if reason:
        return [], {"skipped": reason}
    dtype = dtype_name(resolve_dtype(ea.dtype, device))
    try:
        model_dir = peers_vllm.converted_model(model_path(ea.model))
    except RuntimeError as e:
        return [], {"skipped": f"failed ({e})"[:400]}
    port = free_loopback_port()
    cmd = peers_vllm.server_command(model_dir, port, dtype, ea.max_num_seqs,
                                    ea.enable_prefix_caching, ea.max_model_len)
    env = peers_vllm.vllm_env_vars(len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="conveyor-vllm-serve-") as tmp:
        log_path = args.vllm_server_log or os.path.join(tmp, "server.log")
        print("[bench] starting vLLM's OpenAI server ...", file=sys.stderr, flush=True)
        try:
            with serving_process(cmd, port, "vLLM's OpenAI server", log_path=log_path,
                                 env=env) as base:
                version = httpx.get(base + "/version", timeout=10.0).json().get("version")
                runs = asyncio.run(run_sweep(base, _with_label(args, "vllm")))
        except (RuntimeError, TimeoutError) as e:
            output = open(log_path, errors="replace").read()
            sys.stderr.write(output[-5000:])
            return [], {"skipped": f"failed ({peers_vllm.driver_error(output)}; {e})"[:400]}
    return runs, {"version": version, "command": cmd, "dtype": dtype,
                  "max_num_seqs": ea.max_num_seqs,
                  "enable_prefix_caching": ea.enable_prefix_caching,
                  "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE",
                                              "VLLM_CPU_OMP_THREADS_BIND") if k in env}}


def main(args: argparse.Namespace) -> int:
    peer_info: dict[str, dict[str, Any]] = {}
    if args.from_json:
        runs = []
        for path in args.from_json:
            runs += json.loads(open(path).read())["runs"]
    else:
        if bool(args.spawn) == bool(args.base_url):
            raise SystemExit("bench serve: give exactly one of --base-url URL or --spawn")
        peers = compare_peers(args)
        if args.workload == CHAT_WORKLOAD and (peers or args.endpoint != "completions"):
            raise SystemExit("bench serve: --workload chat_multiturn runs completions against "
                             "conveyor only (no --compare, no --endpoint embeddings)")
        if args.spawn:
            runs = []
            for label, flags in spawn_variants(args):
                with spawned_server(engine_flags(args) + flags, log_path=args.server_log) as base:
                    runs += asyncio.run(run_sweep(base, _with_label(args, label)))
        else:
            runs = asyncio.run(run_sweep(args.base_url, args))
        for name in peers:  # one after the other, never beside Conveyor's server
            if name == "sentence-transformers":
                workload = make_workload(args.workload, args.vocab_size, args.seed,
                                         args.num_prompts)
                texts = workload_texts([r.prompt_token_ids for r in workload.requests],
                                       args.model)
                runs.append(run_sentence_transformers(args, texts))
                peer_info[name] = {"batch_size": args.embed_batch_size,
                                   "repeats": args.repeats}
                continue
            peer_runs, peer_info[name] = run_vllm_sweep(args)
            runs += peer_runs
    print(_table(args, runs))
    for name, info in peer_info.items():
        if "skipped" in info:
            print(f"{name}: {info['skipped']}")
    if args.json and not args.from_json:
        ran = {name: info for name, info in peer_info.items() if "skipped" not in info}
        versions = peer_versions(ran) | (
            {"vllm": ran["vllm"].get("version")} if "vllm" in ran else {})
        write_result(args.json, {"label": args.label, "runs": runs, "peers": peer_info}, versions)
    if args.plot:
        plot_serving(runs, args.plot, title=f"conveyor bench serve ({runs[0]['workload']})"
                     if runs else "")
    return 0 if all(r["completed"] == r["sent"] for r in runs) else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser("serve", help="serving benchmark against an OpenAI-compatible "
                              "server (latency vs request rate)")
    p.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000 (loopback)")
    p.add_argument("--spawn", action="store_true",
                   help="start `conveyor serve` (with the engine flags below) on a free port")
    p.add_argument("--workload", default="W1", choices=[*sorted(SPECS), CHAT_WORKLOAD],
                   help="named workload (built with the engine flag --seed); chat_multiturn: "
                   "multi-turn conversations, --max-concurrency at a time (default "
                   f"{CHAT_CONCURRENCY})")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--num-conversations", type=int, default=None,
                   help="chat_multiturn: conversations (default: the workload's 32)")
    p.add_argument("--chat-spec", default=None,
                   help="chat_multiturn: change the workload's shape, e.g. "
                   "turns=2-3,system_len=64,user_len=16-32,reply_len=8 (keys: "
                   "num_conversations, turns, system_len, user_len, reply_len)")
    p.add_argument("--output-len", type=int, default=None,
                   help="override the workload's output tokens per request")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn below this (default fits Llama vocabularies)")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s, a comma list for a sweep; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--duration", type=float, default=None,
                   help="stop sending new requests after this many seconds (per rate)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=1.0,tpot=0.2 (seconds)")
    p.add_argument("--label", default="conveyor", help="run name in the JSON and the plot")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="latency vs rate PNG (one line per label)")
    p.add_argument("--from-json", nargs="+",
                   help="plot/print these saved runs together instead of running")
    p.add_argument("--server-log", default=None, help="with --spawn: write the server's output here")
    p.add_argument("--endpoint", default="completions", choices=["completions", "embeddings"],
                   help="what each request asks for: a streamed completion of its prompt, or "
                        "the embedding of its prompt's text (default: completions)")
    p.add_argument("--compare", default="",
                   help="with --spawn: then run the same requests against this peer "
                        f"(completions: {', '.join(SERVING_PEERS)}'s server, same model and "
                        f"max_num_seqs; embeddings: {', '.join(EMBEDDING_PEERS)} in this "
                        "process, same model and pooling)")
    p.add_argument("--embed-batch-size", type=int, default=32,
                   help="--compare sentence-transformers: texts per encode call (default: 32)")
    p.add_argument("--repeats", type=int, default=3,
                   help="--compare sentence-transformers: timed passes over the texts; the "
                        "median is reported (default: 3)")
    p.add_argument("--vllm-server-log", default=None,
                   help="with --compare vllm: write vLLM's server output here")
    d = p.add_argument_group("data-parallel replicas (with --spawn)")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="spawn a fleet of this many replicas on Ray Serve (default: 1)")
    d.add_argument("--router", default=None,
                   help="routers, comma-separated: one fleet each, one after the other "
                   "(default: prefix_affinity)")
    d.add_argument("--threads-per-replica", type=int, default=1)
    d.add_argument("--kv-offload-variants", default=None,
                   help="with --spawn: one server per value of --kv-offload-cpu-bytes, "
                   "comma-separated (0: offload off), e.g. 0,268435456")
    d.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of the spawned fleet's local Ray instance (default: every core)")
    d.add_argument("--pd-variants", default=None, metavar="off,P:D",
                   help="with --spawn: one fleet per value, comma-separated: off (plain "
                   "--data-parallel-size replicas) or P:D (conveyor serve --pd P:D), e.g. "
                   "off,1:1 compares prefill/decode disaggregation with plain replicas")
    add_cli_args(p)
    p.set_defaults(func=main)
