"""Runs a benchmark's requests through vLLM's offline API; executed by vLLM's own environment.

``python vllm_driver.py REQUEST.json RESULT.json`` with the Python of the isolated environment
that holds vLLM (``peers_vllm`` builds it): this file imports only the standard library, vLLM
and ``peer_driver.py`` beside it, never Conveyor. The request names the model directory, dtype,
``max_num_seqs``, prefix caching, and the exact token-id requests of the warm-up and of every
timed repeat; the result holds each repeat's wall time and token counts (single stream: time to
first token and decode rate, from a timestamp per engine step), vLLM's version, the settings it
ran with, its load time and the peak RSS of its processes together.
"""

from __future__ import annotations

import os
import sys
import threading
import time

if __package__:  # imported inside Conveyor (the tests)
    from conveyor.bench.peer_driver import (
        driver_main,
        measurement,
        timed_repeats,
        timed_single_stream,
    )
else:  # run as a script by vLLM's environment: this file's folder is first on sys.path
    from peer_driver import driver_main, measurement, timed_repeats, timed_single_stream

ENV_VARS_RECORDED = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                     "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING",
                     "OMP_NUM_THREADS")


class TreeRss:
    """Samples the summed RSS of this process and all its descendants (vLLM's engine core and
    its worker are processes of their own) every ``interval`` seconds; keeps the peak."""

    def __init__(self, interval: float = 0.25) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.peak_kib = max(self.peak_kib, tree_rss_kib(os.getpid()))

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._sample()

    def stop(self) -> float:
        """The peak in MB, the processes still running counted once more now."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak_kib / 1024.0


def tree_rss_kib(root: int) -> int:
    """RSS of ``root`` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields["PPid"])
        rss[int(entry)] = int(fields.get("VmRSS", "0 kB").split()[0])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def _prompts(requests: list[dict]):
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in requests]
    return prompts, params


def run_batch(llm, requests: list[dict]) -> dict:
    prompts, params = _prompts(requests)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    m = measurement(wall, requests, [list(o.outputs[0].token_ids) for o in outputs])
    m["cached_prompt_tokens"] = sum(o.num_cached_tokens or 0 for o in outputs)  # prefix hits
    return m


def run_single_stream(llm, request: dict) -> dict:
    """One request stepped through the engine; a timestamp for each token a step adds."""
    prompts, params = _prompts([request])
    engine = llm.llm_engine

    def generate(on_token) -> None:
        count = 0
        engine.add_request("s1", prompts[0], params[0])
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                for _ in range(n - count):
                    on_token()
                count = n

    return timed_single_stream(generate, request)


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM

    settings = {"dtype": job["dtype"], "max_num_seqs": job["max_num_seqs"],
                "enable_prefix_caching": job["enable_prefix_caching"]}
    rss = TreeRss()
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], seed=job.get("seed", 0), **settings)
    load_s = time.perf_counter() - t0
    config = llm.llm_engine.vllm_config
    settings |= {"max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                 "max_model_len": config.model_config.max_model_len,
                 "block_size": config.cache_config.block_size,
                 "env": {k: os.environ[k] for k in ENV_VARS_RECORDED if k in os.environ}}
    repeats = timed_repeats(job, lambda requests: run_batch(llm, requests),
                            lambda request: run_single_stream(llm, request))
    return {"vllm_version": vllm.__version__, "load_s": load_s, "settings": settings,
            "repeats": repeats, "peak_rss_mb": rss.stop()}


if __name__ == "__main__":
    sys.exit(driver_main(sys.argv, run))
