"""Peer: llama.cpp with its own prompt-lookup decoding, one stream (llama-cpp-python's
high-level ``Llama`` with ``LlamaPromptLookupDecoding`` as its draft model).

The counterpart of Conveyor's ``--speculative-method ngram`` on single-stream workloads (S1,
C1): each step the last tokens are looked up in the prompt and output, and the ``job.setting``
tokens that followed are verified in one ``llama_decode``. Greedy, as every workload is.
"""

from __future__ import annotations

import time

from conveyor.bench.peers import WARMUP_SEED_OFFSET, PeerJob, peak_rss_mb, timed_repeats
from conveyor.bench.report import Measurement, SystemResult
from conveyor.bench.workloads import Workload, make_workload, warmup_workload

DEFAULT_PRED_TOKENS = 4


def _load(model_path: str, n_ctx: int, threads: int, num_pred_tokens: int):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from conveyor.bench.peers_llamacpp import _silence_llama_log

    default_params = llama_cpp.llama_model_default_params

    def params_without_extra_buffers():
        # as peers_llamacpp: the AMX "extra buffer" matmul crashes on this VM
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params_without_extra_buffers
    try:
        llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False,
                              logits_all=True,  # verification reads every proposed row
                              draft_model=LlamaPromptLookupDecoding(
                                  num_pred_tokens=num_pred_tokens))
    finally:
        llama_cpp.llama_model_default_params = default_params
    _silence_llama_log(llama_cpp)
    return llm


def _generate(llm, prompt: list[int], max_tokens: int) -> list[float]:
    """Greedy tokens until ``max_tokens``; returns each token's arrival time."""
    times: list[float] = []
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                          reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens:
            break
    return times


def run_once(llm, workload: Workload) -> Measurement:
    req = workload.requests[0]
    t0 = time.perf_counter()
    times = _generate(llm, req.prompt_token_ids, req.max_tokens)
    wall = time.perf_counter() - t0
    n = len(times)
    decode = (n - 1) / (times[-1] - times[0]) if n > 1 else float("nan")
    return Measurement(wall, len(req.prompt_token_ids), n, times[0] - t0, decode)


def run(job: PeerJob) -> SystemResult:
    k = job.setting or DEFAULT_PRED_TOKENS
    probe = make_workload(job.workload, 32000, job.seed, 1)
    t0 = time.perf_counter()
    llm = _load(job.model_path, probe.max_seq_len + 64, job.threads, k)
    load_s = time.perf_counter() - t0
    try:
        def build(i: int) -> Workload:
            return make_workload(job.workload, llm.n_vocab(), job.seed + i, 1)

        run_once(llm, warmup_workload(build(WARMUP_SEED_OFFSET), 1))
        repeats = timed_repeats(build, job.repeats, lambda w: run_once(llm, w))
    finally:
        llm.close()
    config = f"GGUF as shipped, {job.threads} threads, prompt lookup, {k} tokens proposed"
    return SystemResult(job.system, config, repeats, load_s=load_s, peak_rss_mb=peak_rss_mb())
