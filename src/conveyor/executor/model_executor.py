"""ModelExecutor: runs a real model over the paged KV cache, one forward per scheduler step.

``execute`` does the scheduler's block operations (swap out, swap in, copy), lays the step's
tokens out flat (single-token entries first, then prefill chunks), runs the model once for the
whole batch with logits only at sampling positions, and samples; pooling requests get their
vectors from the hidden states instead (``pooler.py``).

With ``tensor_parallel_size`` N > 1 this process is rank 0 of N: it holds one shard of the model
and its KV heads' cache, starts or meets the other ranks (``conveyor.distributed``), broadcasts
each step's message to them, runs its own shard of the same forward, and samples from the
logits gathered onto it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput
from conveyor.distributed.group import ParallelConfig
from conveyor.distributed.step import (
    ENABLE_LORA,
    INIT_CACHE,
    StepMessage,
    lora_slot_message,
    run_step,
    set_lora_slots,
)
from conveyor.executor.pooler import Pooler, PoolingEntry
from conveyor.executor.prompt_logprobs import PromptScoring, positions_to_score, score
from conveyor.executor.spec_verify import Proposal, proposal_rows, verify
from conveyor.lora.adapter import LoRAAdapter
from conveyor.model.config import ModelConfig
from conveyor.model.device import (
    TRIM_AFTER_TOKENS,
    configure_cpu_allocator,
    dtype_name,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    return_freed_memory,
    use_triton_attention,
)
from conveyor.model.kv_cache import KVCache
from conveyor.model.layers.parallel import TensorParallel, check_tensor_parallel
from conveyor.model.loader import load_model, read_model_config
from conveyor.model.sampler import Sampler, SampleRow


class ModelExecutor:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, kv_cache_dtype: str = "auto", int8_activations: bool = False,
                 parallel: ParallelConfig | None = None, max_num_seqs: int = 64,
                 enforce_eager: bool = False, deterministic: bool = True) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        # before torch's first allocation (and before workers inherit the environment)
        self.trim_after_long_steps = self.device.type == "cpu" and configure_cpu_allocator()
        self.parallel = parallel or ParallelConfig()
        self.deterministic = deterministic  # see docs/determinism.md
        self.workers = None
        self._lora_slot_of: Mapping[int, int] | None = None  # adapter -> slot (enable_lora)
        self.tp: TensorParallel | None = None
        if self.parallel.tensor_parallel_size > 1:
            self._start_workers(model, int8_activations)
        torch.manual_seed(seed)
        try:
            loaded = load_model(model, self.dtype, self.device, int8_activations,
                                self.kv_cache_dtype, deterministic=deterministic, tp=self.tp)
        except Exception as e:
            if self.workers is None:
                raise
            self.workers.check_loaded(f"{type(e).__name__}: {e}")
        if self.workers is not None:
            self.workers.check_loaded(None)
        self.model = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.sampler = Sampler(seed, self.model_config.eos_token_ids)
        self.pooler = Pooler()
        layer = self.model.layers[0]  # this rank's shapes
        self.num_kv_heads, self.num_queries_per_kv = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
        self.attention_kernel = loaded.kernels.attention
        self.deterministic = loaded.kernels.deterministic
        self.kv_cache: KVCache | None = None
        # The CUDA path (executor/cuda_runner.py) runs the single-process forward once the
        # cache exists.
        self.triton_attention = (use_triton_attention(self.device, layer.head_dim)
                                 and self.workers is None)
        self.max_num_seqs, self.enforce_eager = max_num_seqs, enforce_eager
        self.cuda_runner = None

    def _start_workers(self, model: str | None, int8_activations: bool) -> None:
        """Check the split before any process starts, then start or meet the other ranks."""
        from conveyor.distributed.workers import TensorParallelWorkers, threads_per_rank

        size = self.parallel.tensor_parallel_size
        if int8_activations:
            raise ValueError("int8_activations is not supported with tensor_parallel_size > 1")
        check_tensor_parallel(read_model_config(model), size)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(self.parallel))
        self.workers = TensorParallelWorkers(self.parallel, {
            "model": model, "device": self.device.type, "dtype": dtype_name(self.dtype),
            "kv_cache_dtype": dtype_name(self.kv_cache_dtype),
            "deterministic": self.deterministic})
        self.tp = TensorParallel(0, size)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do in a single process)."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
            torch.set_num_threads(self._threads_before)

    def enable_lora(self, num_slots: int, max_rank: int, slot_of: Mapping[int, int]) -> None:
        """Hold up to ``num_slots`` LoRA adapters of rank up to ``max_rank`` in the model;
        ``slot_of``: which slot each adapter sits in (the engine's ``LoRAPool`` keeps it)."""
        if self.workers is not None:
            self.workers.send(StepMessage(kind=ENABLE_LORA, extra=[num_slots, max_rank]))
        self.model.enable_lora(num_slots, max_rank)
        self._lora_slot_of = slot_of

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` (its weights as ``conveyor.lora.adapter`` reads them) in ``slot``,
        in place of what the slot held."""
        if self.workers is not None:
            msg, payload = lora_slot_message(slot, adapter.weights, adapter.scale)
            self.workers.send(msg)
            self.workers.send_tensor(payload)
        self.model.set_lora_slot(slot, adapter.weights, adapter.scale)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block on this rank (its KV heads)."""
        c = self.model_config
        return KVCache.bytes_per_block(c.num_layers, self.num_kv_heads, c.head_dim, block_size,
                                       self.kv_cache_dtype)

    def initialize_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        c = self.model_config
        self.kv_cache = None  # the old one's memory goes first
        if self.workers is not None:
            self.workers.send(StepMessage(kind=INIT_CACHE,
                                          extra=[block_size, num_gpu_blocks, num_cpu_blocks]))
        self.kv_cache = KVCache(c.num_layers, self.num_kv_heads, c.head_dim, block_size,
                                num_gpu_blocks, num_cpu_blocks, self.kv_cache_dtype, self.device)
        if self.triton_attention:
            from conveyor.executor.cuda_runner import CudaModelRunner

            self.cuda_runner = CudaModelRunner(self.model, c, self.kv_cache, self.max_num_seqs,
                                               self.enforce_eager, self.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        so = scheduler_output
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("ModelExecutor.initialize_cache() must be called before execute()")
        msg = StepMessage(swap_out=so.blocks_to_swap_out, swap_in=so.blocks_to_swap_in,
                          copy=so.blocks_to_copy)
        if so.is_empty:
            self._run(msg)
            return ExecutorOutput(sampled_token_ids=[])

        n = len(so.seqs)
        # Decodes first, then prefill chunks, each by length (attention groups pad less); a
        # proposal to verify goes as one-token entries (below) unless the CUDA runner runs it.
        expand = self.cuda_runner is None
        order = sorted(range(n), key=lambda i: (
            so.num_new_tokens[i] != 1 and not (expand and so.seqs[i].spec_token_ids),
            so.num_new_tokens[i], so.seqs[i].num_computed_tokens))
        input_ids: list[int] = []
        starts, counts, tables = [], [], []
        sample_entries: list[int] = []  # original entry index, in logits-row order
        logits_indices: list[int] = []
        scorings: list[PromptScoring] = []
        scored_indices: list[int] = []  # their logits rows follow the sampling ones
        pooling: list[PoolingEntry] = []
        lora_slot_of = self._lora_slot_of  # None: no LoRA
        entry_slots: list[int] = []  # each entry's adapter slot (0: the base model)
        for i in order:
            seq, count = so.seqs[i], so.num_new_tokens[i]
            start = seq.num_computed_tokens
            lora_slot = lora_slot_of[seq.group.lora_id] if seq.group.lora_id else 0
            if seq.spec_token_ids:  # a decode and its proposal: logits at every token
                input_ids.extend(so.token_ids(i))
                logits_indices.extend(range(len(input_ids) - count, len(input_ids)))
                sample_entries.append(i)
                if expand:
                    # as `count` one-token entries over the same blocks: each attends to its
                    # own prefix, and a step of decodes keeps the fused decode path
                    starts.extend(range(start, start + count))
                    counts.extend([1] * count)
                    tables.extend([seq.block_table] * count)
                    entry_slots.extend([lora_slot] * count)
                    continue
            else:
                scoring = positions_to_score(i, seq, start, count)
                if scoring is not None:
                    scorings.append(scoring)
                    first = len(input_ids)
                    scored_indices.extend(range(first, first + len(scoring.targets)))
                if seq.group.pooling_params is not None:
                    pooling.append(PoolingEntry(i, seq, len(input_ids), start, count))
                input_ids.extend(seq.token_ids[start:start + count])
                if so.num_samples(i) > 0:
                    sample_entries.append(i)
                    logits_indices.append(len(input_ids) - 1)
            starts.append(start)
            counts.append(count)
            tables.append(seq.block_table)
            entry_slots.append(lora_slot)

        msg.input_ids, msg.starts, msg.counts, msg.block_tables = input_ids, starts, counts, tables
        if any(entry_slots):
            msg.lora_slots = entry_slots
        msg.logits_indices = (logits_indices + scored_indices) or [len(input_ids) - 1]
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        pooled = None
        hidden_rows = self.pooler.rows(pooling)
        if hidden_rows:
            logits, hidden = self._run(msg, hidden_rows)
        else:
            logits, hidden = self._run(msg), None
        if pooling:
            pooled = self.pooler.pool(pooling, hidden)
        if self.trim_after_long_steps and len(input_ids) > TRIM_AFTER_TOKENS:
            return_freed_memory()  # the step's activations are freed by now
        prompt_lps = None
        if scorings:
            prompt_lps = score(logits[len(logits_indices):], scorings)
            logits = logits[:len(logits_indices)]
        if not sample_entries:
            return ExecutorOutput(sampled_token_ids=sampled, prompt_logprobs=prompt_lps,
                                  pooled=pooled)

        rows, repeats = [], []
        proposals: list[Proposal] = []
        grammar = so.grammar_bitmask  # conveyor.structured_outputs.GrammarBitmask or None
        mask_rows: list[int] = []  # constrained sequences never carry proposals (lookahead.py)
        for i in sample_entries:
            seq, k = so.seqs[i], so.num_samples(i)
            if seq.spec_token_ids:
                proposals.append(Proposal(i, len(rows), seq.spec_token_ids))
                rows.extend(proposal_rows(seq))
                repeats.extend([1] * (len(seq.spec_token_ids) + 1))
                mask_rows += [-1] * (len(seq.spec_token_ids) + 1)
                continue
            group = seq.group
            if grammar is not None:
                mask_rows += [grammar.row_of.get(seq.seq_id, -1)] * k
            for s in range(k):
                rows.append(SampleRow(
                    params=group.sampling_params,
                    prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                    output_token_ids=seq.token_ids[seq.num_prompt_tokens:],
                    sample_index=s if k > 1 else seq.index,
                    position=len(seq.token_ids),
                ))
            repeats.append(k)
        if any(r > 1 for r in repeats):
            # output_size: without it a GPU waits for the sum of the repeats
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0,
                                              output_size=sum(repeats))
        out = self.sampler(logits, rows,
                           (grammar.bitmask, mask_rows) if grammar is not None else None)
        verified = verify(self.sampler, logits, rows, out.token_ids, proposals) if proposals else {}
        row = 0
        for i in sample_entries:
            if i in verified:
                sampled[i] = verified[i]
                row += len(so.seqs[i].spec_token_ids) + 1
                continue
            k = so.num_samples(i)
            sampled[i] = out.token_ids[row:row + k]
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[row:row + k]
            row += k
        return ExecutorOutput(sampled_token_ids=sampled,
                              logprobs=logprobs if out.logprobs is not None else None,
                              prompt_logprobs=prompt_lps, pooled=pooled)

    def forward(self, msg: StepMessage) -> torch.Tensor | None:
        """``msg``'s block operations and one forward: the logits at ``msg.logits_indices``."""
        return self._run(msg)

    def _run(self, msg: StepMessage, hidden_indices: list[int] | None = None) -> Any:
        """The forward's result: logits, or ``(logits, hidden)`` with ``hidden_indices``."""
        if self.cuda_runner is not None:
            cache = self.kv_cache
            cache.swap_out(msg.swap_out)
            cache.swap_in(msg.swap_in)
            cache.copy(msg.copy)
            if not msg.input_ids:
                return None
            set_lora_slots(self.model, msg, self.device)
            return self.cuda_runner.forward(msg.input_ids, msg.block_tables, msg.starts,
                                            msg.counts, msg.logits_indices, hidden_indices)
        if self.workers is not None:
            self.workers.send(msg)
        try:
            return run_step(self.model, self.kv_cache, msg, self.num_queries_per_kv,
                            self.attention_kernel, self.dtype, self.device, self.deterministic,
                            hidden_indices)
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise self.workers.failure(e) from e
