"""Runs a benchmark through llama.cpp (llama-cpp-python); executed by llama.cpp's own environment.

``python llamacpp_driver.py REQUEST.json RESULT.json`` with the Python of the isolated
environment that holds llama-cpp-python (``peers_llamacpp`` builds it): this file imports only
the standard library, ``llama_cpp`` (and numpy, its dependency, for the accuracy figures) and
``peer_driver.py`` beside it, never Conveyor. The request names the GGUF file, the threads and a
``mode``:

- ``parallel``: the warm-up's and every timed repeat's exact token-id requests, greedy, each
  generating exactly its ``max_tokens`` (no end-of-sequence stop). llama-cpp-python's
  high-level ``Llama`` runs one sequence at a time, so this drives the C API the way llama.cpp's
  own parallel example does: ``n_parallel`` sequence slots share one unified KV cache of
  ``n_ctx`` tokens; each ``llama_decode`` batch holds one decode token per running slot plus
  prompt chunks of newly admitted requests (up to ``N_BATCH`` tokens); a finished request's
  slot is freed and refilled from the queue at once; greedy sampling by llama.cpp's sampler.
  A single-stream workload times each token (time to first token, decode rate).
- ``lookup``: one stream through ``Llama`` with ``LlamaPromptLookupDecoding`` as its draft
  model: each step the last tokens are looked up in the prompt and output, and the
  ``num_pred_tokens`` tokens that followed are verified in one ``llama_decode``.
- ``accuracy``: windows of token ids, each with the float reference's next-token
  log-probabilities as a float32 ``.npy`` file of ``[len(window) - 1, vocab]`` (memory-mapped
  here, read some rows at a time); each window is one prefill from position 0 with every
  position's logits, compared with the reference row by row: the summed KL(reference ||
  llama.cpp), the positions whose argmax agrees, llama.cpp's negative log-likelihood of the
  window's next tokens.

Every result carries llama-cpp-python's version, the version libllama reports, llama.cpp's
system info (the CPU features it was built for), the load time and the driver process's peak
RSS.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

if __package__:  # imported inside Conveyor (the tests)
    from conveyor.bench.peer_driver import (
        driver_main,
        measurement,
        timed_repeats,
        timed_single_stream,
    )
else:  # run as a script by llama.cpp's environment: this file's folder is first on sys.path
    from peer_driver import driver_main, measurement, timed_repeats, timed_single_stream

N_BATCH = 2048  # tokens per llama_decode call (split into N_UBATCH internally)
N_UBATCH = 512
ACCURACY_ROWS = 64  # reference rows compared at a time: bounded memory at a 262k vocabulary

_LOG_CALLBACK = None  # llama.cpp keeps a pointer to it: it must outlive every context


def _silence_log(lc) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, user_data: None)
    lc.llama_log_set(_LOG_CALLBACK, None)


def model_params(default_params):
    """llama.cpp's default model parameters (``default_params()``) less the AMX extra buffers."""
    p = default_params()
    # The AMX "extra buffer" matmul segfaulted on an AMX VM (cpuid reports AMX, the kernel
    # crashed in ggml_backend_amx_mul_mat); llama.cpp then runs its AVX-512 (or AVX2) kernels.
    p.use_extra_bufts = False
    return p


class Model:
    """One loaded GGUF file and a context over it (``n_seq_max`` sequences, one KV pool)."""

    def __init__(self, lc, path: str, n_ctx: int, n_seq_max: int, threads: int,
                 n_batch: int = N_BATCH) -> None:
        self.lc = lc
        lc.llama_backend_init()
        _silence_log(lc)
        params = model_params(lc.llama_model_default_params)
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(N_UBATCH, n_batch)
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one KV pool shared by all slots, like Conveyor's block pool
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1

    def decode(self) -> None:
        if self.lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache too small?)")


# ----------------------------------------------------------------------------- parallel slots

@dataclass
class _Slot:
    prompt_len: int
    max_tokens: int
    tokens: list[int]  # prompt + generated so far
    computed: int = 0  # tokens already in the KV cache
    pending: int = 0  # tokens in the batch being decoded

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prompt_len


class ParallelRunner:
    """``n_parallel`` sequence slots over one model; greedy, every request to its max_tokens."""

    def __init__(self, model: Model, n_parallel: int) -> None:
        lc = model.lc
        self.m, self.n_parallel = model, n_parallel
        self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())

    def close(self) -> None:
        self.m.lc.llama_sampler_free(self.sampler)

    def generate(self, requests: list[dict], on_token=None) -> int:
        """Run every request to its ``max_tokens``; returns the tokens generated."""
        m, lc = self.m, self.m.lc
        lc.llama_memory_clear(m.memory, True)
        queue = list(reversed(requests))
        slots: dict[int, _Slot] = {}
        generated = 0
        while queue or slots:
            for s in range(self.n_parallel):
                if s not in slots and queue:
                    r = queue.pop()
                    prompt = list(r["prompt_token_ids"])
                    slots[s] = _Slot(len(prompt), r["max_tokens"], prompt)
            m.batch.n_tokens = 0
            sample_at: list[tuple[int, int]] = []  # (slot, batch index)
            for s, slot in slots.items():  # one decode token per running sequence first
                if slot.computed == len(slot.tokens) - 1 and slot.prefilled:
                    m.add(slot.tokens[-1], slot.computed, s, True)
                    slot.pending = 1
                    sample_at.append((s, m.batch.n_tokens - 1))
            for s, slot in slots.items():  # then prompt chunks, as many as fit
                room = m.n_batch - m.batch.n_tokens
                if slot.prefilled or room == 0:
                    continue
                chunk = slot.tokens[slot.computed:slot.computed + room]
                end = slot.computed + len(chunk)
                for j, tok in enumerate(chunk):
                    m.add(tok, slot.computed + j, s, slot.computed + j == len(slot.tokens) - 1)
                slot.pending = len(chunk)
                if end == len(slot.tokens):
                    sample_at.append((s, m.batch.n_tokens - 1))
            m.decode()
            for slot in slots.values():
                slot.computed += slot.pending
                slot.pending = 0
            for s, index in sample_at:
                slot = slots[s]
                slot.tokens.append(lc.llama_sampler_sample(self.sampler, m.ctx, index))
                generated += 1
                if on_token is not None:
                    on_token()
                if len(slot.tokens) - slot.prompt_len >= slot.max_tokens:
                    lc.llama_memory_seq_rm(m.memory, s, -1, -1)
                    del slots[s]
        return generated


def run_parallel(lc, job: dict) -> dict:
    t0 = time.perf_counter()
    model = Model(lc, job["model"], job["n_ctx"], job["n_parallel"], job["threads"])
    load_s = time.perf_counter() - t0
    runner = ParallelRunner(model, job["n_parallel"])
    try:
        check_vocab(model.n_vocab, job)

        def run_batch(requests: list[dict]) -> dict:
            t0 = time.perf_counter()
            n = runner.generate(requests)
            return measurement(time.perf_counter() - t0, requests, [n])

        def run_single(request: dict) -> dict:
            return timed_single_stream(lambda on_token: runner.generate([request], on_token),
                                       request)

        repeats = timed_repeats(job, run_batch, run_single)
    finally:
        runner.close()
        model.close()
    settings = {"n_parallel": job["n_parallel"], "n_ctx": job["n_ctx"], "n_batch": N_BATCH,
                "n_ubatch": N_UBATCH, "threads": job["threads"], "kv_unified": True}
    return {"load_s": load_s, "settings": settings, "repeats": repeats}


def check_vocab(n_vocab: int, job: dict) -> None:
    if n_vocab != job["vocab_size"]:
        raise ValueError(f"llama.cpp reads a vocabulary of {n_vocab} tokens from {job['model']}, "
                         f"the bench drew its prompts from {job['vocab_size']}")


# ----------------------------------------------------------------------------- prompt lookup

def run_lookup(lc, job: dict) -> dict:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = job["num_pred_tokens"]
    # Llama takes its model parameters from the C bindings' llama_model_default_params (the
    # module llama_cpp.llama_cpp, not the package's copy of the name): for this load, they lack
    # the AMX extra buffers (model_params)
    api = lc.llama_cpp
    default_params = api.llama_model_default_params
    api.llama_model_default_params = lambda: model_params(default_params)
    t0 = time.perf_counter()
    try:
        llm = lc.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=N_UBATCH,
                       n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
                       logits_all=True,  # verification reads every proposed row
                       draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))
    finally:
        api.llama_model_default_params = default_params
    load_s = time.perf_counter() - t0
    _silence_log(lc)
    try:
        check_vocab(llm.n_vocab(), job)

        def run_single(request: dict) -> dict:
            def generate(on_token) -> None:
                n = 0
                for _ in llm.generate(request["prompt_token_ids"], top_k=1, top_p=1.0,
                                      min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                    on_token()
                    n += 1
                    if n == request["max_tokens"]:
                        break

            return timed_single_stream(generate, request)

        def run_batch(requests: list[dict]) -> dict:  # the lookup peer is one stream
            raise ValueError("llama.cpp's prompt lookup runs single-stream workloads only")

        repeats = timed_repeats(job, run_batch, run_single)
    finally:
        llm.close()
    settings = {"num_pred_tokens": k, "n_ctx": job["n_ctx"], "n_batch": N_UBATCH,
                "threads": job["threads"]}
    return {"load_s": load_s, "settings": settings, "repeats": repeats}


# ----------------------------------------------------------------------------- accuracy

def window_figures(logits, reference, next_ids: list[int],
                   rows: int = ACCURACY_ROWS) -> tuple[float, int, float]:
    """One window against the reference: (summed KL(reference || llama.cpp), positions whose
    argmax agrees, llama.cpp's summed negative log-likelihood of ``next_ids``). ``logits``:
    llama.cpp's ``[n, vocab]``; ``reference``: log-probabilities ``[n, vocab]``; ``rows`` at a
    time, in float64."""
    import numpy as np

    kl, agree, nll = 0.0, 0, 0.0
    for start in range(0, len(next_ids), rows):
        end = min(start + rows, len(next_ids))
        q = np.asarray(logits[start:end], dtype=np.float64)
        q = q - q.max(axis=1, keepdims=True)
        q -= np.log(np.exp(q).sum(axis=1, keepdims=True))
        p = np.asarray(reference[start:end], dtype=np.float64)
        kl += float((np.exp(p) * (p - q)).sum())
        agree += int((p.argmax(axis=1) == q.argmax(axis=1)).sum())
        nll -= float(q[np.arange(end - start), next_ids[start:end]].sum())
    return kl, agree, nll


def run_accuracy(lc, job: dict) -> dict:
    import numpy as np

    windows = job["windows"]
    longest = max(len(w["token_ids"]) for w in windows) - 1
    t0 = time.perf_counter()
    model = Model(lc, job["model"], longest, 1, job["threads"], n_batch=longest)
    load_s = time.perf_counter() - t0
    n, kl, agree, nll = 0, 0.0, 0, 0.0
    try:
        for w in windows:
            ids = w["token_ids"]
            reference = np.load(w["reference"], mmap_mode="r")
            if reference.shape != (len(ids) - 1, model.n_vocab):
                raise ValueError(f"{w['reference']}: reference of shape {reference.shape}, "
                                 f"expected {(len(ids) - 1, model.n_vocab)} (this window's "
                                 f"positions by llama.cpp's vocabulary)")
            lc.llama_memory_clear(model.memory, True)
            model.batch.n_tokens = 0
            for pos, token in enumerate(ids[:-1]):  # the last token predicts nothing here
                model.add(token, pos, 0, True)
            model.decode()
            logits = np.ctypeslib.as_array(lc.llama_get_logits(model.ctx),
                                           shape=(len(ids) - 1, model.n_vocab))
            k, a, l_ = window_figures(logits, reference, ids[1:])
            kl, agree, nll, n = kl + k, agree + a, nll + l_, n + len(ids) - 1
    finally:
        model.close()
    return {"load_s": load_s, "tokens": n, "kl_sum": kl, "agree": agree, "nll_sum": nll,
            "settings": {"n_ctx": longest, "threads": job["threads"]}}


# ----------------------------------------------------------------------------- main

MODES = {"parallel": run_parallel, "lookup": run_lookup, "accuracy": run_accuracy}


def run(job: dict) -> dict:
    import llama_cpp

    result = MODES[job["mode"]](llama_cpp, job)
    return {"llama_cpp_python_version": llama_cpp.__version__,
            "llama_cpp_version": llama_cpp.llama_version().decode(),  # libllama's own
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            **result,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


if __name__ == "__main__":
    sys.exit(driver_main(sys.argv, run))
