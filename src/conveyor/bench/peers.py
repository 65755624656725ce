"""The peer systems the throughput bench compares Conveyor with, and what one peer run needs.

Each peer lives in its own module (``peers_transformers``, ``peers_llamacpp``, ``peers_vllm``)
exposing ``run(job) -> SystemResult``; this file names them, says whether each can run here, and
holds the helpers they share. A peer that cannot run is reported as skipped with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.bench.report import Measurement
from conveyor.bench.workloads import Workload

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


# name -> (module holding run(), Python package it needs here, what it is); vLLM needs none here:
# it runs from an environment of its own, built on first use
PEERS: dict[str, tuple[str, str, str]] = {
    "transformers": ("conveyor.bench.peers_transformers", "transformers",
                     "HF transformers generate(), static batches, left padding"),
    "transformers-cb": ("conveyor.bench.peers_transformers", "transformers",
                        "HF transformers continuous batching, generate_batch()"),
    "llamacpp": ("conveyor.bench.peers_llamacpp", "llama_cpp",
                 "llama.cpp through llama-cpp-python, n parallel sequences"),
    "vllm": ("conveyor.bench.peers_vllm", "",
             "vLLM's CPU build, offline LLM.generate(), from its own environment"),
    "llamacpp-lookup": ("conveyor.bench.peers_llamacpp_lookup", "llama_cpp",
                        "llama.cpp prompt-lookup decoding (LlamaPromptLookupDecoding), one stream"),
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
