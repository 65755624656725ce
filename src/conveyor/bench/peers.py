"""The peer systems the throughput bench compares Conveyor with, and what one peer run needs.

Each peer lives in its own module (``peers_transformers``, ``peers_llamacpp``, ``peers_vllm``)
exposing ``run(job) -> SystemResult``; this file names them, says whether each can run here, and
holds the helpers they share. A peer that cannot run is reported as skipped with the reason.
vLLM and llama.cpp run from environments of their own (``peer_env``) through a driver script:
``driver_workloads`` is what such a request carries, ``driver_measurements`` reads the repeats
back.
"""

from __future__ import annotations

import importlib
import importlib.util
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.bench.report import Measurement
from conveyor.bench.workloads import Workload, is_single_stream, make_workload, warmup_workload

WARMUP_SEED_OFFSET = 1000  # warm-up prompts come from seed + this: never the timed ones


@dataclass
class PeerJob:
    system: str  # a key of PEERS
    model_path: str  # GGUF file (the same one Conveyor loads)
    workload: str
    seed: int
    num_requests: int | None
    repeats: int
    dtype: str  # torch dtype name Conveyor ran in (transformers peers)
    setting: int | None = None  # static batch size (transformers) / parallel sequences (llamacpp)
    threads: int = 2
    device: str = "cpu"  # the transformers peers run where Conveyor did
    prefix_caching: bool = True  # Conveyor's setting, which vLLM follows


# name -> (module holding run(), Python package it needs here, what it is); vLLM and llama.cpp
# need none here: they run from environments of their own, built on first use
PEERS: dict[str, tuple[str, str, str]] = {
    "transformers": ("conveyor.bench.peers_transformers", "transformers",
                     "HF transformers generate(), static batches, left padding"),
    "transformers-cb": ("conveyor.bench.peers_transformers", "transformers",
                        "HF transformers continuous batching, generate_batch()"),
    "llamacpp": ("conveyor.bench.peers_llamacpp", "",
                 "llama.cpp through llama-cpp-python, n parallel sequences, from its own "
                 "environment"),
    "vllm": ("conveyor.bench.peers_vllm", "",
             "vLLM's CPU build, offline LLM.generate(), from its own environment"),
    "llamacpp-lookup": ("conveyor.bench.peers_llamacpp", "",
                        "llama.cpp prompt-lookup decoding (LlamaPromptLookupDecoding), one "
                        "stream, from llama.cpp's environment"),
}


def skip_reason(name: str) -> str | None:
    """None when peer ``name`` can run here, else the line the table prints instead."""
    if name not in PEERS:
        raise ValueError(f"--compare: unknown peer {name!r}; known: {', '.join(PEERS)}")
    if not PEERS[name][1]:  # a peer with an environment of its own says itself
        return importlib.import_module(PEERS[name][0]).skip_reason()
    if importlib.util.find_spec(PEERS[name][1]) is None:
        return "skipped (not installed)"
    if name == "transformers-cb":
        from transformers import GenerationMixin

        if not hasattr(GenerationMixin, "generate_batch"):
            import transformers

            return f"skipped (transformers {transformers.__version__} has no generate_batch)"
    return None


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed_repeats(build: Callable[[int], Workload], repeats: int,
                  run_once: Callable[[Workload], Measurement | int]) -> list[Measurement]:
    """Repeat ``k`` runs ``run_once(build(k))``; an int return is the output tokens generated.

    Every system builds repeat ``k``'s workload with seed ``seed + k``: the same prompts for
    all, fresh ones each repeat (no prefix cache carries one repeat into the next).
    """
    out = []
    for k in range(repeats):
        workload = build(k)
        t0 = time.perf_counter()
        result = run_once(workload)
        wall = time.perf_counter() - t0
        if isinstance(result, Measurement):
            out.append(result)
            continue
        if result != workload.num_output_tokens:
            raise RuntimeError(f"peer generated {result} tokens, the workload asks for "
                               f"{workload.num_output_tokens}")
        out.append(Measurement(wall, workload.num_prompt_tokens, result))
    return out


# ----------------------------------------------------------------------------- driver peers

def requests_json(workload: Workload) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
            for r in workload.requests]


def driver_workloads(job: PeerJob, vocab_size: int, num_requests: int | None = None
                     ) -> tuple[list[Workload], dict[str, Any]]:
    """Each repeat's workload (repeat ``k``: seed ``seed + k``, as every system builds it) and
    the part of a driver's request that carries them: whether the workload is a single stream
    (one request: a single-stream workload stretched by ``--num-requests`` runs as a batch, as
    Conveyor's does), the warm-up's and every repeat's exact token-id requests.
    ``num_requests`` overrides the job's (a one-stream peer)."""
    n = num_requests or job.num_requests
    workloads = [make_workload(job.workload, vocab_size, job.seed + k, n)
                 for k in range(job.repeats)]
    warmup = warmup_workload(make_workload(job.workload, vocab_size,
                                           job.seed + WARMUP_SEED_OFFSET, n))
    return workloads, {"single_stream": is_single_stream(job.workload) and (n or 1) == 1,
                       "warmup": requests_json(warmup),
                       "repeats": [requests_json(w) for w in workloads]}


def driver_measurements(result: dict[str, Any], workloads: list[Workload],
                        peer: str) -> list[Measurement]:
    """The repeats of a driver's result as Measurements, each checked to have generated every
    token its workload asks for."""
    fields = Measurement.__dataclass_fields__
    repeats = [Measurement(**{k: v for k, v in m.items() if k in fields})
               for m in result["repeats"]]
    if len(repeats) != len(workloads):
        raise RuntimeError(f"{peer} ran {len(repeats)} repeats, the bench asked for "
                           f"{len(workloads)}")
    for workload, m in zip(workloads, repeats, strict=True):
        if m.output_tokens != workload.num_output_tokens:
            raise RuntimeError(f"{peer} generated {m.output_tokens} tokens, the workload asks "
                               f"for {workload.num_output_tokens}")
    return repeats
