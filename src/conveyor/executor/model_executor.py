"""ModelExecutor: runs a real model over the paged KV cache, one forward per scheduler step.

``execute`` does the scheduler's block operations (swap out, swap in, copy), lays the step's
tokens out flat (single-token entries first, then prefill chunks), runs the model once for the
whole batch with logits only at sampling positions, and samples.
"""

from __future__ import annotations

import torch

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput
from conveyor.executor.kv_cache import KVCache
from conveyor.model.config import ModelConfig
from conveyor.model.device import (
    TRIM_AFTER_TOKENS,
    configure_cpu_allocator,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    return_freed_memory,
    use_attention_kernel,
)
from conveyor.model.layers.attention import build_attention_metadata
from conveyor.model.loader import load_model
from conveyor.model.sampler import Sampler, SampleRow


class ModelExecutor:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, kv_cache_dtype: str = "auto", int8_activations: bool = False,
                 deterministic: bool = True) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        # before torch's first allocation, see its docstring
        self.trim_after_long_steps = self.device.type == "cpu" and configure_cpu_allocator()
        torch.manual_seed(seed)
        self.deterministic = deterministic  # see docs/determinism.md
        loaded = load_model(model, self.dtype, self.device, int8_activations, deterministic)
        self.model = loaded.model
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.sampler = Sampler(seed, self.model_config.eos_token_ids)
        c = self.model_config
        self.attention_kernel = use_attention_kernel(self.device, self.dtype, c.head_dim,
                                                     self.kv_cache_dtype)
        self.kv_cache: KVCache | None = None

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.model_config
        return KVCache.bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, block_size,
                                       self.kv_cache_dtype)

    def initialize_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        c = self.model_config
        self.kv_cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, block_size,
                                num_gpu_blocks, num_cpu_blocks, self.kv_cache_dtype, self.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        so = scheduler_output
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("ModelExecutor.initialize_cache() must be called before execute()")
        cache.swap_out(so.blocks_to_swap_out)
        cache.swap_in(so.blocks_to_swap_in)
        cache.copy(so.blocks_to_copy)
        if so.is_empty:
            return ExecutorOutput(sampled_token_ids=[])

        n = len(so.seqs)
        # Decodes first, then prefill chunks, each by length (attention groups pad less).
        order = sorted(range(n), key=lambda i: (so.num_new_tokens[i] != 1, so.num_new_tokens[i],
                                                so.seqs[i].num_computed_tokens))
        input_ids: list[int] = []
        starts, counts, tables = [], [], []
        sample_entries: list[int] = []  # original entry index, in logits-row order
        logits_indices: list[int] = []
        for i in order:
            seq, count = so.seqs[i], so.num_new_tokens[i]
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + count])
            starts.append(start)
            counts.append(count)
            tables.append(seq.block_table)
            if so.num_samples(i) > 0:
                sample_entries.append(i)
                logits_indices.append(len(input_ids) - 1)

        meta = build_attention_metadata(tables, starts, counts, cache.block_size,
                                        self.model_config.num_queries_per_kv, self.device,
                                        self.attention_kernel, self.dtype, self.deterministic)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        logits = self.model(torch.tensor(input_ids, device=self.device), meta.positions,
                            cache.layers, meta,
                            torch.tensor(logits_indices or [len(input_ids) - 1], device=self.device))
        if self.trim_after_long_steps and len(input_ids) > TRIM_AFTER_TOKENS:
            return_freed_memory()  # the step's activations are freed by now
        if not sample_entries:
            return ExecutorOutput(sampled_token_ids=sampled)

        rows, repeats = [], []
        for i in sample_entries:
            seq, k = so.seqs[i], so.num_samples(i)
            group = seq.group
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
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        out = self.sampler(logits, rows)
        row = 0
        for i, k in zip(sample_entries, repeats, strict=True):
            sampled[i] = out.token_ids[row:row + k]
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[row:row + k]
            row += k
        return ExecutorOutput(sampled_token_ids=sampled,
                              logprobs=logprobs if out.logprobs is not None else None)
