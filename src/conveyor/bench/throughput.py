"""`conveyor bench throughput`: Conveyor and its peers on one named workload, in one invocation.

Every system configuration runs in its own worker process (``python -m
conveyor.bench.throughput --worker JOB OUT``) one after another, so each gets the whole
machine, its own thread settings and its own peak-RSS figure. Repeat ``k`` of every system
uses the workload built with seed ``seed + k`` (fresh prompts, so Conveyor's prefix cache
cannot carry one repeat's prompts into the next). Conveyor runs first and tells the peers its
dtype. The parent then prints one table (best / median of the repeats, ratios to Conveyor),
the machine's roofline for the workload, and with ``--profile`` the engine-overhead breakdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.bench.peers import PEERS, WARMUP_SEED_OFFSET, PeerJob, peak_rss_mb, skip_reason
from conveyor.bench.provenance import PEER_REPORTED_VERSIONS, peer_versions
from conveyor.bench.report import (
    Measurement,
    SystemResult,
    format_table,
    plot_throughput,
    write_json,
    write_result,
)
from conveyor.bench.speculative import acceptance_line, speculative_methods, speculative_variants
from conveyor.bench.workloads import (
    SPECS,
    Workload,
    is_single_stream,
    make_workload,
    warmup_workload,
)
from conveyor.core.stats import SchedulerStats

if TYPE_CHECKING:
    import torch

    from conveyor.bench.roofline import MachineRates
    from conveyor.engine.args import EngineArgs

# ----------------------------------------------------------------------------- --profile

def profile_engine(engine, run) -> dict[str, Any]:
    """Call ``run()`` with timers around the engine's parts; summarize time outside the forward.

    Wraps, on these instances only and for the duration of the call: ``engine.step``, the
    scheduler's ``schedule``/``update``, the executor's ``execute``, the output processor's
    ``process`` (detokenization, stop strings), plus forward hooks on the executor's model.
    """
    import torch

    device = str(getattr(engine.executor, "device", "cpu"))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    clock = time.perf_counter
    steps: list[dict[str, float]] = []
    current: dict[str, float] = {}
    restore = []

    def wrap(obj, name: str, key: str, after=None) -> None:
        original = getattr(obj, name)
        own = name in vars(obj)

        def timed(*a, **kw):
            t0 = clock()
            out = original(*a, **kw)
            current[key] = current.get(key, 0.0) + clock() - t0
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)
        restore.append(lambda: setattr(obj, name, original) if own else delattr(obj, name))

    def scheduled(out) -> None:
        current["batch"] = len(out.seqs)
        current["decode"] = float(bool(out.seqs) and all(n == 1 for n in out.num_new_tokens))

    def step_done(_) -> None:
        steps.append(dict(current))
        current.clear()

    model = engine.executor.model
    started: list[float] = []

    def pre(*_):
        sync()
        started.append(clock())

    def post(*_):
        sync()
        current["forward"] = current.get("forward", 0.0) + clock() - started.pop()

    if getattr(engine, "_grammar", None) is not None:  # structured outputs (--structured)
        from conveyor.model import sampler as sampler_module

        wrap(engine._grammar, "bitmask", "mask_fill")
        wrap(sampler_module, "apply_token_bitmask", "mask_apply")
    wrap(engine.scheduler, "schedule", "schedule", scheduled)
    wrap(engine.scheduler, "update", "update")
    wrap(engine.executor, "execute", "execute")
    if hasattr(engine, "_outputs"):
        wrap(engine._outputs, "process", "outputs")
    wrap(engine, "step", "step", step_done)
    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
        for undo in reversed(restore):
            undo()
    ran = [s for s in steps if s.get("batch")]
    summary = {"all_steps": _profile_summary(ran)}
    decodes = [s for s in ran if s.get("decode")]
    if decodes:
        top = max(s["batch"] for s in decodes)
        summary["decode_at_max_batch"] = _profile_summary([s for s in decodes if s["batch"] == top])
    return summary


def _profile_summary(steps: list[dict[str, float]]) -> dict[str, Any]:
    if not steps:
        return {}
    total = {k: sum(s.get(k, 0.0) for s in steps) for k in (
        "step", "schedule", "update", "execute", "forward", "outputs", "mask_fill", "mask_apply")}
    step = total["step"]
    parts = {
        "schedule+update": total["schedule"] + total["update"],
        "input prep+sampling": total["execute"] - total["forward"] - total["mask_apply"],
        "outputs+detokenize": total["outputs"],
    }
    mask = total["mask_fill"] + total["mask_apply"]
    if mask:
        parts["grammar mask"] = mask
    parts["other"] = step - total["forward"] - sum(parts.values())
    batches = sorted({int(s["batch"]) for s in steps})
    return {
        "steps": len(steps),
        "batch": batches[0] if len(batches) == 1 else f"{batches[0]}-{batches[-1]}",
        "mean_step_ms": 1000 * step / len(steps),
        "forward_pct": 100 * total["forward"] / step,
        "overhead_pct": 100 * (step - total["forward"]) / step,
        "breakdown_pct": {k: 100 * v / step for k, v in parts.items()},
        "mask_ms_per_step": 1000 * mask / len(steps),
        "mask_fill_ms_per_step": 1000 * total["mask_fill"] / len(steps),
    }


# ----------------------------------------------------------------------------- conveyor worker

def _conveyor_generate(llm, workload: Workload, structured: str | None = None,
                       loras: list | None = None) -> list:
    """``loras``: LoRA requests, given to the requests round robin."""
    from conveyor.bench.structured import structured_outputs
    from conveyor.core.sampling_params import SamplingParams

    constraint = structured_outputs(structured)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                             structured_outputs=constraint) for r in workload.requests]
    lora_requests = ([loras[i % len(loras)] for i in range(len(workload.requests))]
                     if loras else None)
    return llm.generate([r.prompt_token_ids for r in workload.requests], params, use_tqdm=False,
                        lora_request=lora_requests)


def _measure(workload: Workload, outputs: list, wall: float) -> Measurement:
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if generated != workload.num_output_tokens:
        raise RuntimeError(f"conveyor generated {generated} tokens, the workload asks for "
                           f"{workload.num_output_tokens}")
    m = Measurement(wall, workload.num_prompt_tokens, generated)
    if len(outputs) == 1:  # single stream: the engine's own timestamps (scheduler clock)
        metrics = outputs[0].metrics
        m.ttft_s = metrics.first_token_time - metrics.arrival_time
        m.decode_tokens_per_s = (generated - 1) / (metrics.finished_time - metrics.first_token_time)
    return m


def _memory_budget(llm) -> dict[str, float]:
    from conveyor.model.layers.embedding import VocabEmbedding
    from conveyor.model.layers.linear import DenseMethod, Linear

    engine = llm.llm_engine
    model = engine.executor.model
    weights = sum(t.numel() * t.element_size()
                  for t in list(model.parameters()) + list(model.buffers()))
    # a packed weight (and its block copies) lives in its Linear's method, not in a Parameter
    weights += sum(m.method.nbytes() for m in model.modules()
                   if isinstance(m, Linear) and not isinstance(m.method, DenseMethod))
    weights += sum(m.nbytes() for m in model.modules() if isinstance(m, VocabEmbedding))
    kv = engine.num_gpu_blocks * engine.executor.kv_cache_bytes_per_block(
        engine.engine_args.block_size)
    return {"weights_mb": weights / 2**20, "kv_cache_mb": kv / 2**20,
            "budget_mb": (weights + kv) / 2**20 + 500.0}


def _step_weight_bytes(llm) -> list[int]:
    """Matmul weight bytes a step of 1..max_num_seqs tokens reads (quantized copies at small
    batches), for the roofline."""
    from conveyor.model.layers.linear import Linear

    linears = [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, Linear)]
    return [sum(m.weight_bytes(rows) for m in linears)
            for rows in range(1, llm.llm_engine.engine_args.max_num_seqs + 1)]


def run_conveyor(job: dict[str, Any]) -> SystemResult:
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm import LLM

    engine_args = EngineArgs(**job["engine_args"])
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    load_s = time.perf_counter() - t0
    config = llm.llm_engine.model_config
    vocab = config.vocab_size
    name, seed, n = job["workload"], job["seed"], job["num_requests"]
    structured = job.get("structured")
    loras = _lora_requests(config, job.get("lora"))
    _conveyor_generate(llm, warmup_workload(make_workload(name, vocab, seed + WARMUP_SEED_OFFSET, n)),
                       structured, loras)
    repeats = []
    tp = llm.llm_engine.executor.tp
    if tp is not None:
        tp.timer.reset()
    steps_before, wall = llm.llm_engine.get_stats().num_steps, 0.0
    first = job.get("first_repeat", 0)  # an interleaved run's repeat: its own workload seed
    for k in range(first, first + job["repeats"]):
        workload = make_workload(name, vocab, seed + k, n)
        t0 = time.perf_counter()
        outputs = _conveyor_generate(llm, workload, structured, loras)
        repeats.append(_measure(workload, outputs, time.perf_counter() - t0))
        wall += repeats[-1].wall_s
    steps = llm.llm_engine.get_stats().num_steps - steps_before
    dtype = str(llm.llm_engine.executor.dtype).removeprefix("torch.")
    kv_dtype = str(llm.llm_engine.executor.kv_cache_dtype).removeprefix("torch.")
    label = f"{dtype}, {engine_args.policy}, max_num_seqs {engine_args.max_num_seqs}"
    if llm.llm_engine.executor.weight_compute == "int8":
        label += ", int8 compute"
    if engine_args.tensor_parallel_size > 1:
        label += f", TP {engine_args.tensor_parallel_size}"
    if kv_dtype != dtype:
        label += f", {kv_dtype} KV cache"
    if name == "W2":
        label += ", prefix caching " + ("on" if engine_args.enable_prefix_caching else "off")
    if structured:
        label += f", structured {structured}"
    if loras:
        pool = llm.llm_engine.lora_pool
        label += (f", {len(loras)} LoRA adapters of rank {job['lora']['rank']} (max_loras "
                  f"{engine_args.max_loras}, max_cpu_loras {pool.max_host}: "
                  f"{pool.num_installs} slot installs, {pool.num_reads} re-reads)")
    extra: dict[str, Any] = {
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "weight_compute": llm.llm_engine.executor.weight_compute,
        "engine_args": dataclasses.asdict(engine_args),
        "model_config": {"name": config.name, **config.shape_dict()},
        "memory": _memory_budget(llm),
        "step_weight_bytes": _step_weight_bytes(llm),
        "stats": dataclasses.asdict(llm.llm_engine.get_stats()),
        "tensor_parallel": {
            "size": engine_args.tensor_parallel_size, "steps": steps,
            "step_ms": 1e3 * wall / max(steps, 1),
            "all_reduce_ms_per_step": 1e3 * tp.timer.all_reduce_s / max(steps, 1) if tp else 0.0,
            "all_reduces_per_step": tp.timer.num_all_reduces / max(steps, 1) if tp else 0.0,
        },
    }
    rss = peak_rss_mb()  # before profiling, which adds nothing but keep it clean
    if job.get("profile"):
        workload = make_workload(name, vocab, seed + first + job["repeats"], n)
        extra["profile"] = profile_engine(llm.llm_engine,
                                          lambda: _conveyor_generate(llm, workload, structured))
    return SystemResult("conveyor", label, repeats, load_s=load_s, peak_rss_mb=rss, extra=extra)


def _lora_requests(config, lora: dict[str, int] | None) -> list | None:
    """``lora`` ({"count", "rank"}): that many random adapters, written to a temporary
    directory that lives as long as this worker."""
    if not lora:
        return None
    import tempfile

    from conveyor.bench.lora_adapters import write_random_adapters
    from conveyor.lora.request import LoRARequest

    root = tempfile.mkdtemp(prefix="conveyor-bench-lora-")
    paths = write_random_adapters(config, lora["count"], lora["rank"], root)
    return [LoRARequest(f"adapter{k}", k + 1, p) for k, p in enumerate(paths)]


def worker_main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    if job["system"] == "conveyor":
        result = run_conveyor(job)
    else:
        import importlib

        peer = PeerJob(**job["peer"])
        result = importlib.import_module(PEERS[peer.system][0]).run(peer)
    write_json(out_path, result.to_dict())
    return 0


# ----------------------------------------------------------------------------- orchestration

def run_worker(job: dict[str, Any], system: str, config: str) -> SystemResult:
    """Run one job in a fresh Python process; a failure becomes a skipped row with its reason."""
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        job_path, out_path, log_path = (os.path.join(tmp, f) for f in ("job.json", "out.json",
                                                                         "stderr.log"))
        Path(job_path).write_text(json.dumps(job))
        print(f"[bench] running {system} ({config}) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "conveyor.bench.throughput", "--worker",
                                   job_path, out_path], stderr=log, check=False)
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = Path(log_path).read_text().strip().splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            last = tail[-1][:100] if tail else ""
            reason = f"exit {proc.returncode}: {last}" if last else f"exit {proc.returncode}"
            return SystemResult(system, config, skipped=f"failed ({reason})")
        print(f"[bench] {system} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
              flush=True)
        return SystemResult.from_dict(json.loads(Path(out_path).read_text()))


def merge_repeats(first: SystemResult, more: SystemResult) -> SystemResult:
    """One row's result from two of its interleaved runs: the repeats of both, the steps timed
    over both."""
    if first.skipped or more.skipped:
        return first if first.skipped else more
    tp, more_tp = first.extra["tensor_parallel"], more.extra["tensor_parallel"]
    steps = tp["steps"] + more_tp["steps"]
    wall = sum(m.wall_s for m in first.repeats + more.repeats)
    extra = {**first.extra, "tensor_parallel": {**tp, "steps": steps,
                                                "step_ms": 1e3 * wall / max(steps, 1)}}
    return dataclasses.replace(first, repeats=first.repeats + more.repeats,
                               peak_rss_mb=max(first.peak_rss_mb or 0, more.peak_rss_mb or 0),
                               extra=extra)


def engine_variant(engine_args: EngineArgs, changes: str) -> EngineArgs:
    """``engine_args`` with the engine flags in ``changes`` changed, as ``name=value`` pairs
    (``"kv_cache_dtype=bfloat16 max_num_seqs=32"``, booleans ``true``/``false``): for
    ``--also-with``, another Conveyor row in the same run. Values are checked as the flags'."""
    from conveyor.engine.args import add_cli_args, from_cli_args

    fields = {f.name for f in dataclasses.fields(engine_args)}
    argv = []
    for pair in shlex.split(changes):
        name, sep, value = pair.partition("=")
        name = name.removeprefix("--").replace("-", "_")
        if not sep or name not in fields:
            raise ValueError(f"--also-with {changes!r}: {pair!r} is not NAME=VALUE with NAME an "
                             f"engine flag")
        flag = name.replace("_", "-")
        if isinstance(getattr(engine_args, name), bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--also-with {changes!r}: {name} is true or false")
            argv.append(f"--{flag}" if value.lower() == "true" else f"--no-{flag}")
        else:
            argv += [f"--{flag}", value]
    parser = argparse.ArgumentParser(prog="--also-with", add_help=False, exit_on_error=False)
    add_cli_args(parser)
    parser.set_defaults(**dataclasses.asdict(engine_args))
    try:
        return from_cli_args(parser.parse_args(argv))
    except argparse.ArgumentError as e:
        raise ValueError(f"--also-with {changes!r}: {e}") from None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def peer_jobs(args: argparse.Namespace, model_path: str, dtype: str) -> list[PeerJob]:
    from conveyor.model.device import resolve_device

    jobs = []
    for name in [c.strip() for c in (args.compare or "").split(",") if c.strip()]:
        settings: list[int | None] = [None]
        single = is_single_stream(args.workload)
        if name == "transformers" and not single:
            settings = _ints(args.transformers_batch_sizes)
        elif name == "llamacpp" and not single:
            settings = _ints(args.llamacpp_parallel)
        elif name == "vllm":
            settings = [args.max_num_seqs]
        systems = [(name, s) for s in settings]
        if name == "llamacpp" and single and "ngram" in speculative_methods(args.speculative):
            systems.append(("llamacpp-lookup", args.num_speculative_tokens))
        for system, s in systems:
            jobs.append(PeerJob(system, model_path, args.workload, args.seed, args.num_requests,
                                args.peer_repeats or args.repeats, dtype, s, args.threads,
                                resolve_device(args.device).type, args.enable_prefix_caching))
    return jobs


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from conveyor.engine.args import from_cli_args
    from conveyor.model.device import dtype_name, resolve_device, resolve_dtype
    from conveyor.model.loader import model_path as resolve_model_path

    tp_sizes = args.tensor_parallel_size
    engine_args = dataclasses.replace(from_cli_args(args), tensor_parallel_size=tp_sizes[0])
    device = resolve_device(engine_args.device)  # --device cuda without a GPU stops here
    model_path = resolve_model_path(engine_args.model)
    for name in [c.strip() for c in (args.compare or "").split(",") if c.strip()]:
        skip_reason(name)  # unknown names fail before anything runs
    # (engine args, what the progress line says, what the table row's config adds)
    variants = (speculative_variants(engine_args, args.speculative)
                or [(engine_args, "engine flags", "")])
    if args.workload == "W2":  # with vs without prefix caching (the row says so already)
        variants.append((dataclasses.replace(engine_args, enable_prefix_caching=False),
                         "prefix caching off", ""))
    variants += [(engine_variant(engine_args, changes), f"with {changes}", f" (with {changes})")
                 for changes in args.also_with or []]
    variants += [(dataclasses.replace(engine_args, tensor_parallel_size=size),
                  f"tensor_parallel_size {size}", "") for size in tp_sizes[1:]]
    if args.structured:  # the same engine, every request under a JSON schema
        variants.insert(1, (engine_args, f"structured {args.structured}", ""))
    if args.lora:  # the same engine with LoRA on, requests spread over --lora adapters
        max_loras = args.max_loras if args.max_loras > 1 else min(args.lora, args.max_num_seqs)
        variants.insert(1, (dataclasses.replace(engine_args, enable_lora=True,
                                                max_loras=max_loras,
                                                max_lora_rank=max(args.lora_rank,
                                                                  engine_args.max_lora_rank)),
                            f"{args.lora} LoRA adapters", ""))

    base = {"system": "conveyor", "workload": args.workload, "seed": args.seed,
            "num_requests": args.num_requests, "profile": args.profile}
    jobs = []
    for i, (ea, what, _) in enumerate(variants):
        structured = args.structured if what.startswith("structured ") else None
        jobs.append({**base, "engine_args": dataclasses.asdict(ea), "structured": structured,
                     "profile": args.profile and (i == 0 or structured is not None),
                     "lora": ({"count": args.lora, "rank": args.lora_rank}
                              if what.endswith("LoRA adapters") else None)})
    # Interleaved: one process per repeat, the rows taking turns, so that a drift in the host's
    # speed falls on every row alike.
    rounds, per_job = (args.repeats, 1) if args.interleave else (1, args.repeats)
    results: list[SystemResult] = []
    for k in range(rounds):
        for i, (job, (_, what, _)) in enumerate(zip(jobs, variants, strict=True)):
            result = run_worker({**job, "repeats": per_job, "first_repeat": k,
                                 "profile": job["profile"] and k == 0}, "conveyor", what)
            if k == 0:
                results.append(result)
            else:
                results[i] = merge_repeats(results[i], result)
    for result, (_, _, note) in zip(results, variants, strict=True):
        result.config += note
    conveyor = results[0]
    rates = None
    if not args.no_roofline and conveyor.repeats:
        rates = measure_rates(dtype_name(resolve_dtype(engine_args.dtype, device)), device,
                              conveyor.extra.get("weight_compute") == "int8")
    dtype = conveyor.extra.get("dtype") or (args.dtype if args.dtype != "auto" else "bfloat16")
    for peer in peer_jobs(args, model_path, dtype):
        reason = skip_reason(peer.system)
        config = f"setting {peer.setting}" if peer.setting else ""
        if reason:
            results.append(SystemResult(peer.system, config, skipped=reason))
            continue
        results.append(run_worker({"system": peer.system, "peer": dataclasses.asdict(peer)},
                                  peer.system, config))
    payload: dict[str, Any] = {
        "workload": dataclasses.asdict(SPECS[args.workload]) | {"name": args.workload,
                                                                "seed": args.seed},
        "results": [r.to_dict() for r in results],
        "orchestrator_peak_rss_mb": peak_rss_mb(),
    }
    if rates is not None:
        payload["roofline"] = roofline_summary(args, conveyor, rates)
    return payload


def measure_rates(dtype: str, device: torch.device, int8: bool) -> MachineRates:
    """This machine's GEMM rate in ``dtype``, memory bandwidth and, for a run under integer
    compute (``int8``), int8 GEMM rate, measured once Conveyor has run (its workers are gone)."""
    from conveyor.bench.roofline import measure_machine

    gemms = f"int8 and {dtype} GEMM rates" if int8 else f"{dtype} GEMM rate"
    print(f"[bench] measuring this machine's {gemms} and memory bandwidth ({device.type}) ...",
          file=sys.stderr, flush=True)
    return measure_machine(dtype, device=str(device), int8=int8)


def roofline_summary(args: argparse.Namespace, conveyor: SystemResult,
                     rates: MachineRates) -> dict[str, Any]:
    """The roofline of Conveyor's run: under integer compute where the run used it and the
    int8 rate was measured (``workload_roofline``'s ``weight_compute``), else the float one."""
    from conveyor.bench.roofline import workload_roofline
    from conveyor.model.shape import ModelShape

    ea = conveyor.extra["engine_args"]
    shape = ModelShape.from_dict(conveyor.extra["model_config"])
    workload = make_workload(args.workload, shape.vocab_size, args.seed, args.num_requests)
    weight_compute = ("int8" if conveyor.extra.get("weight_compute") == "int8"
                      and rates.int8_ops is not None else "float")
    roof = workload_roofline(shape, workload, rates, conveyor.extra["dtype"], ea["max_num_seqs"],
                             ea["max_num_batched_tokens"], ea["enable_prefix_caching"],
                             conveyor.extra.get("step_weight_bytes"),
                             conveyor.extra.get("kv_cache_dtype"), weight_compute)
    single = is_single_stream(args.workload)
    if single:
        achieved = conveyor.best_and_median("decode_tokens_per_s")[0]
        ideal = roof.single_stream_decode_tokens_per_s
    else:
        achieved = conveyor.best_and_median("output_tokens_per_s")[0]
        ideal = roof.output_tokens_per_s
    return {"machine": dataclasses.asdict(rates), "model": dataclasses.asdict(shape),
            **roof.to_dict(), "metric": "decode tok/s" if single else "output tok/s",
            "conveyor_best": achieved, "fraction_of_roofline": achieved / ideal,
            "weight_compute": weight_compute}


def format_roofline(r: dict[str, Any]) -> str:
    """The roofline's lines under the table; under integer compute (``r["weight_compute"]``,
    absent from older result files: float) they name the int8 rate and the GGUF blocks."""
    m = r["machine"]
    integer = r.get("weight_compute") == "int8"
    ideal = (r["single_stream_decode_tokens_per_s"] if r["metric"] == "decode tok/s"
             else r["output_tokens_per_s"])
    gemm = f"{m.get('dtype', 'bfloat16')} GEMM {m['gemm_flops'] / 1e9:,.0f} GFLOP/s"
    if integer:
        gemm = (f"int8 GEMM {m['int8_ops'] / 1e9:,.0f} GOP/s "
                f"({m.get('int8_source', 'torch._int_mm')}) for the linear "
                f"layers, {gemm} for attention")
    where = (f"{m['device']}, {m['num_threads']} SMs" if m.get("device", "cpu") != "cpu"
             else f"{m['num_threads']} threads")
    work, weights = (("T ops", "the GGUF blocks under integer compute, at every batch size")
                     if integer else ("TFLOP", "quantized copies at small batches"))
    return "\n".join([
        f"roofline: {gemm}, memory read {m['mem_bandwidth'] / 1e9:.1f} GB/s ({where}, measured "
        f"in the run)",
        f"  workload: {r['flops'] / 1e12:.2f} {work}, {r['bytes'] / 1e9:.1f} GB moved (weights "
        f"as the engine holds them, {weights}); ideal time "
        f"{r['time_s']:.2f}s (prefill {r['prefill_s']:.2f}s + decode {r['decode_s']:.2f}s)",
        f"  ideal {r['metric']} {ideal:,.0f}; conveyor best {r['conveyor_best']:,.0f} = "
        f"{100 * r['fraction_of_roofline']:.0f}% of the roofline",
    ])


def format_profile(p: dict[str, Any]) -> str:
    lines = ["engine overhead (--profile: time outside the model forward, % of step time)"]
    for key in ("all_steps", "decode_at_max_batch"):
        s = p.get(key)
        if not s:
            continue
        parts = ", ".join(f"{k} {v:.1f}%" for k, v in s["breakdown_pct"].items())
        mask = (f"; grammar mask {s['mask_ms_per_step']:.2f} ms/step (filling the bitmask "
                f"{s['mask_fill_ms_per_step']:.2f}, applying it the rest)"
                if s.get("mask_ms_per_step") else "")
        lines.append(f"  {key} ({s['steps']} steps, batch {s['batch']}): overhead "
                     f"{s['overhead_pct']:.1f}% of {s['mean_step_ms']:.1f} ms/step — {parts}{mask}")
    return "\n".join(lines)


def print_report(payload: dict[str, Any], workload: str) -> None:
    results = [SystemResult.from_dict(d) for d in payload["results"]]
    print(f"\nworkload {workload}: {SPECS[workload].description}")
    print(format_table(results, single_stream=is_single_stream(workload)))
    for line in report_notes(payload, workload):
        print(line)


def report_notes(payload: dict[str, Any], workload: str) -> list[str]:
    """The lines printed under the table: prefix-cache hits, speculative acceptance, step and
    all-reduce times, the peers' settings, memory, the roofline, the profile, structured outputs."""
    results = [SystemResult.from_dict(d) for d in payload["results"]]
    notes: list[str] = []
    ran = {r.config: r for r in results if r.system == "conveyor" and r.repeats}
    if workload == "W2" and len(ran) == 2:
        on, off = list(ran.values())
        x = on.best_and_median("output_tokens_per_s")[0] / off.best_and_median(
            "output_tokens_per_s")[0]
        notes.append(f"W2 prefix caching: {x:.2f}x output tok/s with vs without")
    scheduler_stats = {config: SchedulerStats(**(r.extra.get("stats") or {}).get("scheduler", {}))
                       for config, r in ran.items()}
    for config, stats in scheduler_stats.items():
        if stats.prefix_cache_queries:
            notes.append(f"conveyor ({config}): prefix cache hits {stats.prefix_cache_hits:,} of "
                         f"{stats.prefix_cache_queries:,} prompt tokens queried, "
                         f"{stats.num_preemptions} preemptions")
    for config, stats in scheduler_stats.items():
        line = acceptance_line(stats)
        if line:
            notes.append(f"conveyor ({config}): {line}")
    for r in ran.values():
        tp = r.extra.get("tensor_parallel") or {}
        if tp.get("size", 1) > 1:
            notes.append(f"conveyor ({r.config}): all-reduce {tp['all_reduce_ms_per_step']:.2f} "
                         f"ms of a {tp['step_ms']:.1f} ms step on rank 0 "
                         f"({tp['all_reduces_per_step']:.0f} all-reduces a step, waits for the "
                         f"slowest rank included)")
        elif len(ran) > 1 and tp:
            notes.append(f"conveyor ({r.config}): {tp['step_ms']:.1f} ms a step, no all-reduce")
    for r in results:
        settings = r.extra.get("settings") if r.system == "vllm" else None
        if settings:
            env = settings.get("env", {})
            notes.append(f"vllm {r.extra['vllm_version']}: loaded in {r.load_s:.0f}s (its "
                         f"torch.compile warm-up included); max_num_batched_tokens "
                         f"{settings['max_num_batched_tokens']}, block size "
                         f"{settings['block_size']}, KV cache "
                         f"{env.get('VLLM_CPU_KVCACHE_SPACE', '?')} GiB, OpenMP threads on cores "
                         f"{env.get('VLLM_CPU_OMP_THREADS_BIND', '?')}")
            hits = [h for h in r.extra.get("cached_prompt_tokens", []) if h is not None]
            if hits and sum(hits):
                notes.append(f"vllm: prefix cache hits {sum(hits):,} of "
                             f"{sum(m.prompt_tokens for m in r.repeats):,} prompt tokens")
    conveyor = results[0]
    mem = conveyor.extra.get("memory")
    if mem and conveyor.peak_rss_mb:
        notes.append(f"conveyor peak RSS {conveyor.peak_rss_mb:,.0f} MB; weights "
                     f"{mem['weights_mb']:,.0f} MB + KV cache {mem['kv_cache_mb']:,.0f} MB + "
                     f"500 MB = {mem['budget_mb']:,.0f} MB")
    if "roofline" in payload:
        notes += format_roofline(payload["roofline"]).splitlines()
    for r in results:
        if r.system == "conveyor" and r.extra.get("profile"):
            if len(ran) > 1:
                notes.append(f"conveyor ({r.config}):")
            notes += format_profile(r.extra["profile"]).splitlines()
    structured = [r for r in ran.values() if ", structured " in r.config]
    if structured and conveyor.repeats:
        x = structured[0].best_and_median("output_tokens_per_s")[0] / conveyor.best_and_median(
            "output_tokens_per_s")[0]
        notes.append(f"structured outputs: {x:.2f}x the unconstrained output tok/s (best of "
                     f"each)")
    return notes


def ran_peer_versions(results: list[dict[str, Any]]) -> dict[str, str | None]:
    """Distribution -> version of every peer with a timed row (vLLM's and llama.cpp's as their
    drivers reported)."""
    ran = [r for r in results if r["repeats"] and r["system"] != "conveyor"]
    versions = peer_versions(r["system"] for r in ran)
    for r in ran:
        if r["system"] in PEER_REPORTED_VERSIONS:
            distribution, key = PEER_REPORTED_VERSIONS[r["system"]]
            versions[distribution] = r["extra"].get(key)
    return versions


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    try:
        payload = run_all(args)
    except ValueError as e:  # a bad --compare or --also-with: refused before anything runs
        raise SystemExit(f"conveyor bench throughput: {e}") from None
    print_report(payload, args.workload)
    if args.json:
        write_result(args.json, payload, ran_peer_versions(payload["results"]))
    if args.plot:
        results = [SystemResult.from_dict(d) for d in payload["results"]]
        plot_throughput(results, args.plot, f"conveyor bench throughput, workload {args.workload}"
                        f" ({SPECS[args.workload].description})", is_single_stream(args.workload))
    return 0 if payload["results"] and payload["results"][0]["repeats"] else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser("throughput", help="offline throughput on a named workload, "
                              "side by side with transformers and llama.cpp")
    p.add_argument("--workload", default="W1", choices=sorted(SPECS),
                   help="named workload (built with the engine flag --seed)")
    p.add_argument("--compare", default="",
                   help=f"comma list of peers to run too: {', '.join(PEERS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=None,
                   help="override the workload's request count (smoke runs)")
    p.add_argument("--peer-repeats", type=int, default=None,
                   help="repeats for the peers (default: --repeats; slow peers take minutes)")
    p.add_argument("--threads", type=int, default=2, help="threads for the peers")
    p.add_argument("--transformers-batch-sizes", default="64",
                   help="static batch sizes to run transformers at (one row each)")
    p.add_argument("--llamacpp-parallel", default="16,64",
                   help="parallel sequences to run llama.cpp with (one row each)")
    p.add_argument("--also-with", action="append", metavar="NAME=VALUE ...",
                   help="run Conveyor again in the same run with these engine flags changed "
                        "(e.g. kv_cache_dtype=bfloat16); repeatable; the row's ratio columns "
                        "compare it with the first")
    p.add_argument("--interleave", action="store_true",
                   help="run each Conveyor row's repeats in processes of their own, the rows "
                        "taking turns (row 1's first repeat, row 2's first, ...), so that a drift "
                        "in the host's speed falls on every row alike (each repeat reloads the "
                        "model)")
    p.add_argument("--speculative", default="",
                   help="comma list of speculative methods, one Conveyor row each (e.g. "
                        "ngram,off; off: none); with --compare llamacpp on a single-stream "
                        "workload, llama.cpp's prompt lookup runs too")
    p.add_argument("--profile", action="store_true",
                   help="one extra Conveyor pass timing the engine outside the model forward")
    p.add_argument("--structured", choices=["json"], default=None,
                   help="also run the workload with every request under a JSON schema (one more "
                        "Conveyor row; prints the ratio and, with --profile, the mask time)")
    p.add_argument("--lora", type=int, default=0, metavar="N",
                   help="also run the engine with LoRA on and the requests spread round robin "
                        "over N random adapters of --lora-rank on every projection "
                        "(max_loras: --max-loras if above 1, else N)")
    p.add_argument("--lora-rank", type=int, default=8, help="rank of the --lora adapters")
    p.add_argument("--no-roofline", action="store_true", help="skip the machine micro-benchmarks")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--plot", help="bar chart PNG of the table")
    add_cli_args(p)
    for action in p._actions:  # a sweep here: one Conveyor row per size
        if action.dest == "tensor_parallel_size":
            action.type, action.default = _sizes, [1]
            action.help = ("tensor-parallel sizes, comma-separated: one Conveyor row each, with "
                           "the all-reduce time per step (default: 1)")
    p.set_defaults(func=main)


def _sizes(text: str) -> list[int]:
    sizes = _ints(text)
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be >= 1, got {text!r}")
    return sizes


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    sys.exit("usage: python -m conveyor.bench.throughput --worker JOB.json OUT.json")
