"""Peers: llama.cpp (through llama-cpp-python's C bindings) on the same GGUF file, from an
environment of its own.

llama-cpp-python is a source distribution: installing it compiles llama.cpp (several minutes on
2 cores, a C/C++ compiler needed; CMake comes from the registry where the machine has none), for
this machine's CPU (``GGML_NATIVE``). So it is never imported here: it lives in an isolated
environment (``peer_env``), built on first use, and the bench writes the exact token-id requests
and the settings to a JSON file, runs ``llamacpp_driver.py`` with that environment's Python, and
reads back its JSON (timings, llama-cpp-python's version, the settings it ran with, its load
time, its peak RSS).

- ``llamacpp``: ``job.setting`` parallel sequence slots over one unified KV cache (one slot on
  a single-stream workload), greedy, ``ignore_eos`` (every request runs to its ``max_tokens``).
- ``llamacpp-lookup``: llama.cpp's own prompt-lookup decoding on single-stream workloads (S1,
  C1), the counterpart of Conveyor's ``--speculative-method ngram``: ``job.setting`` tokens
  proposed a step.

``accuracy`` runs llama.cpp over the windows of ``conveyor bench accuracy``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from conveyor.bench.peer_env import PeerEnv
from conveyor.bench.peers import PeerJob, driver_measurements, driver_workloads
from conveyor.bench.report import SystemResult
from conveyor.bench.workloads import is_single_stream

LLAMA_CPP_PACKAGE = "llama-cpp-python==0.3.36"
# An sdist: pip builds it (--no-cache-dir: never a wheel cached from another build's
# CMAKE_ARGS). GGML_NATIVE compiles for this machine's CPU (llama.cpp's default, unless
# SOURCE_DATE_EPOCH is set); a CMAKE_ARGS in the bench's environment replaces it.
ENV = PeerEnv("llamacpp", [["--no-cache-dir", LLAMA_CPP_PACKAGE]], "llama_cpp",
              label="llama.cpp", build_env={"CMAKE_ARGS": "-DGGML_NATIVE=ON"},
              build_tools=[("cc", "a C compiler (Debian: apt-get install gcc)"),
                           ("c++", "a C++ compiler (Debian: apt-get install g++)")])
DRIVER = Path(__file__).with_name("llamacpp_driver.py")
DEFAULT_PARALLEL = 16
DEFAULT_PRED_TOKENS = 4
CTX_MARGIN = 16  # KV cells per slot beyond the longest request


@functools.cache
def skip_reason() -> str | None:
    """None when llama.cpp's environment is ready (built now if need be), else the row's text."""
    return ENV.skip_reason()


def model_reason(model_path: str) -> str | None:
    """llama.cpp reads GGUF files: None for one, else the row's text."""
    return ("skipped (llama.cpp reads GGUF files; the model is an HF directory)"
            if Path(model_path).is_dir() else None)


def vocab_size(model_path: str) -> int:
    from conveyor.model.loader import read_model_config

    return read_model_config(model_path).vocab_size


def run(job: PeerJob) -> SystemResult:
    lookup = job.system == "llamacpp-lookup"
    n_parallel = 1 if lookup or is_single_stream(job.workload) else (
        job.setting or DEFAULT_PARALLEL)
    pred_tokens = job.setting or DEFAULT_PRED_TOKENS
    config = f"GGUF as shipped, {job.threads} threads, " + (
        f"prompt lookup, {pred_tokens} tokens proposed" if lookup
        else f"{n_parallel} parallel sequences")
    reason = model_reason(job.model_path) or skip_reason()
    if reason:
        return SystemResult(job.system, config, skipped=reason)
    vocab = vocab_size(job.model_path)
    workloads, requests = driver_workloads(job, vocab, 1 if lookup else None)
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"]
                  for rs in (requests["warmup"], *requests["repeats"]) for r in rs)
    request = {"mode": "lookup" if lookup else "parallel",
               "model": str(Path(job.model_path).resolve()), "threads": job.threads,
               "vocab_size": vocab, "n_parallel": n_parallel,
               # a lookup step verifies its proposals past the end too
               "n_ctx": n_parallel * (longest + CTX_MARGIN + (pred_tokens if lookup else 0)),
               "num_pred_tokens": pred_tokens,
               **requests}
    result = ENV.run_driver(DRIVER, request)
    repeats = driver_measurements(result, workloads, "llama.cpp")
    version = result["llama_cpp_python_version"]
    extra = {key: result[key] for key in ("llama_cpp_python_version", "llama_cpp_version",
                                          "system_info", "settings")}
    return SystemResult(job.system, f"{config}, llama-cpp-python {version}", repeats,
                        load_s=result["load_s"], peak_rss_mb=result["peak_rss_mb"], extra=extra)


def accuracy(model_path: str, windows: list[dict[str, Any]],
             threads: int | None = None) -> dict[str, Any]:
    """llama.cpp over ``windows`` (each ``{"token_ids", "reference"}``: the float reference's
    log-probabilities of its next tokens, a float32 ``.npy`` file): the driver's result,
    with ``tokens``, ``kl_sum``, ``agree`` and ``nll_sum`` over every position. The caller
    checks ``skip_reason()`` first."""
    request = {"mode": "accuracy", "model": str(Path(model_path).resolve()),
               "threads": threads or len(os.sched_getaffinity(0)), "windows": windows}
    return ENV.run_driver(DRIVER, request)
