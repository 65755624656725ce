"""Peer: llama.cpp (through llama-cpp-python's C bindings) on the same GGUF file.

llama-cpp-python's high-level ``Llama`` runs one sequence at a time, so this drives the C API
directly the way llama.cpp's own parallel example does: ``job.setting`` sequence slots share one
unified KV cache; each ``llama_decode`` batch holds one decode token per running slot plus prompt
chunks of newly admitted requests (up to ``N_BATCH`` tokens); a finished request's slot is freed
and refilled from the queue at once; greedy sampling by llama.cpp's own sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from conveyor.bench.peers import WARMUP_SEED_OFFSET, PeerJob, peak_rss_mb, timed_repeats
from conveyor.bench.report import Measurement, SystemResult
from conveyor.bench.workloads import (
    BenchRequest,
    Workload,
    is_single_stream,
    make_workload,
    warmup_workload,
)

N_BATCH = 2048  # tokens per llama_decode call (split into N_UBATCH internally)
N_UBATCH = 512


class LlamaCppRunner:
    """One model + context with ``n_parallel`` sequence slots."""

    def __init__(self, model_path: str, n_parallel: int, n_ctx: int, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.n_parallel = n_parallel
        lc.llama_backend_init()
        _silence_llama_log(lc)
        mparams = lc.llama_model_default_params()
        # The AMX "extra buffer" matmul segfaults on this VM (cpuid reports AMX, the kernel
        # crashes in ggml_backend_amx_mul_mat); llama.cpp then runs its AVX-512 kernels.
        mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_UBATCH
        cparams.n_seq_max = n_parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one KV pool shared by all slots, like Conveyor's block pool
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        self.sampler = chain
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        lc = self.lc
        lc.llama_sampler_free(self.sampler)
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1

    def generate(self, workload: Workload, on_token=None) -> int:
        """Run every request to its ``max_tokens``; returns the tokens generated."""
        lc = self.lc
        lc.llama_memory_clear(self.memory, True)
        queue = list(reversed(workload.requests))
        slots: dict[int, _Slot] = {}
        generated = 0
        while queue or slots:
            for s in range(self.n_parallel):
                if s not in slots and queue:
                    req = queue.pop()
                    slots[s] = _Slot(req, list(req.prompt_token_ids))
            self.batch.n_tokens = 0
            sample_at: list[tuple[int, int]] = []  # (slot, batch index)
            for s, slot in slots.items():  # one decode token per running sequence first
                if slot.computed == len(slot.tokens) - 1 and slot.prefilled:
                    self._add(slot.tokens[-1], slot.computed, s, True)
                    slot.pending = 1
                    sample_at.append((s, self.batch.n_tokens - 1))
            for s, slot in slots.items():  # then prompt chunks, as many as fit
                room = N_BATCH - self.batch.n_tokens
                if slot.prefilled or room == 0:
                    continue
                chunk = slot.tokens[slot.computed:slot.computed + room]
                end = slot.computed + len(chunk)
                for j, tok in enumerate(chunk):
                    self._add(tok, slot.computed + j, s, slot.computed + j == len(slot.tokens) - 1)
                slot.pending = len(chunk)
                if end == len(slot.tokens):
                    sample_at.append((s, self.batch.n_tokens - 1))
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache too small?)")
            for slot in slots.values():
                slot.computed += slot.pending
                slot.pending = 0
            for s, index in sample_at:
                slot = slots[s]
                slot.tokens.append(lc.llama_sampler_sample(self.sampler, self.ctx, index))
                generated += 1
                if on_token is not None:
                    on_token()
                if len(slot.tokens) - len(slot.req.prompt_token_ids) >= slot.req.max_tokens:
                    lc.llama_memory_seq_rm(self.memory, s, -1, -1)
                    del slots[s]
        return generated


@dataclass
class _Slot:
    req: BenchRequest
    tokens: list[int]  # prompt + generated so far
    computed: int = 0  # tokens already in the KV cache
    pending: int = 0  # tokens in the batch being decoded

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.req.prompt_token_ids)


_LOG_CALLBACK = None  # llama.cpp keeps a pointer to it: it must outlive every context


def _silence_llama_log(lc) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, user_data: None)
    lc.llama_log_set(_LOG_CALLBACK, None)


def run_single_stream(runner: LlamaCppRunner, workload: Workload) -> Measurement:
    req = workload.requests[0]
    times: list[float] = []
    t0 = time.perf_counter()
    n = runner.generate(Workload(workload.name, "", workload.seed, [req]),
                        on_token=lambda: times.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    decode = (n - 1) / (times[-1] - times[0]) if n > 1 else float("nan")
    return Measurement(wall, len(req.prompt_token_ids), n, times[0] - t0, decode)


def run(job: PeerJob) -> SystemResult:
    single = is_single_stream(job.workload)
    n_parallel = 1 if single else (job.setting or 16)
    probe = make_workload(job.workload, 32000, job.seed, job.num_requests)
    n_ctx = n_parallel * (probe.max_seq_len + 16)
    t0 = time.perf_counter()
    runner = LlamaCppRunner(job.model_path, n_parallel, n_ctx, job.threads)
    load_s = time.perf_counter() - t0
    try:
        def build(k: int) -> Workload:
            return make_workload(job.workload, runner.vocab_size, job.seed + k, job.num_requests)

        runner.generate(warmup_workload(build(WARMUP_SEED_OFFSET)))
        run_once = (lambda w: run_single_stream(runner, w)) if single else runner.generate
        repeats = timed_repeats(build, job.repeats, run_once)
    finally:
        runner.close()
    config = f"GGUF as shipped, {job.threads} threads, {n_parallel} parallel sequences"
    return SystemResult(job.system, config, repeats, load_s=load_s, peak_rss_mb=peak_rss_mb())
