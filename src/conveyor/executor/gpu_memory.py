"""How many KV-cache blocks fit on a GPU, and how swapped blocks move between it and the
pinned host pool.

Sizing follows vLLM's rule: the engine may fill ``gpu_memory_utilization`` of the card; what is
already in use (the weights, other processes) counts against that, and room is kept for a
step's activations and the CUDA graphs. The rest is KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.executor.model_executor import ModelExecutor

GRAPH_AND_WORKSPACE_BYTES = 512 * 2**20  # CUDA graphs' pool, cuBLAS workspaces, Triton scratch


def activation_bytes(max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int,
                     intermediate_size: int, vocab_size: int, elem_size: int) -> int:
    """A bound on one step's live activations: the residual stream, the fused QKV and gate/up
    outputs of a full token budget, and float32 logits for every sequence (a sampler copy)."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * elem_size
    return max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab_size * 4


def gpu_kv_cache_blocks(free: int, total: int, utilization: float, bytes_per_block: int,
                        reserved: int) -> int:
    """Blocks that fit in ``utilization * total`` bytes, less what is in use now
    (``total - free``, from ``torch.cuda.mem_get_info``) and ``reserved``."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization) - (total - free) - reserved
    blocks = budget // bytes_per_block
    if blocks < 1:
        used = (total - free) / 2**30
        raise ValueError(
            f"no KV-cache block fits: {utilization:.2f} of {total / 2**30:.1f} GiB, with "
            f"{used:.1f} GiB in use and {reserved / 2**30:.1f} GiB kept for activations, leaves "
            f"{max(budget, 0) / 2**20:.0f} MiB for blocks of {bytes_per_block / 2**20:.2f} MiB; "
            f"raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return blocks


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as (src start, dst start, length) runs where both sides advance
    together: a swap of consecutive blocks becomes one copy per layer, not one per block."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def cuda_kv_cache_blocks(executor: ModelExecutor, block_size: int, utilization: float,
                         max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """``gpu_kv_cache_blocks`` for a loaded executor, from the card's memory as torch sees it
    now (the weights are in)."""
    import torch

    c = executor.model_config
    free, total = torch.cuda.mem_get_info(executor.device)
    elem = torch.empty((), dtype=executor.dtype).element_size()
    reserved = GRAPH_AND_WORKSPACE_BYTES + activation_bytes(
        max_num_batched_tokens, max_num_seqs, c.hidden_size, c.intermediate_size, c.vocab_size,
        elem)
    return gpu_kv_cache_blocks(free, total, utilization,
                               executor.kv_cache_bytes_per_block(block_size), reserved)
