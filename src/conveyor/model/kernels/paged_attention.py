"""Paged attention on the CPU, decodes and prefill chunks (``torch.ops.conveyor.paged_attention``,
``paged_attention.cpp``).

``attention_kernel_available()`` builds the kernels on first use (see ``build.py``) and says
whether this one can run here; ``CONVEYOR_KERNELS=off`` turns them off (the model then runs
``backends/sdpa.py``'s ``scaled_dot_product_attention``).
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.build import kernel_ops

# (queries' dtype, cache's dtype) the kernel takes
_DTYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
           (torch.float32, torch.bfloat16)}


def attention_kernel_available(device: torch.device, dtype: torch.dtype,
                               cache_dtype: torch.dtype | None = None,
                               head_dim: int = 64) -> bool:
    """For queries of ``dtype`` over a cache of ``cache_dtype`` (default: the same), heads of
    ``head_dim`` (16..256 by 16s)."""
    return (device.type == "cpu" and (dtype, cache_dtype or dtype) in _DTYPES
            and head_dim % 16 == 0 and head_dim <= 256 and kernel_ops() is not None)


def _lane_view(k_cache: torch.Tensor) -> torch.Tensor:
    """The kernel's key cache as it lies: [num_blocks, num_kv_heads, head_dim / P, block_size, P],
    P elements to a 32-bit lane (1 float32, 2 bf16)."""
    blocks, block_size, kv_heads, head_dim = k_cache.shape
    per_lane = 4 // k_cache.element_size()
    return k_cache.view(blocks, kv_heads, head_dim // per_lane, block_size, per_lane)


def keys_as_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """The kernel's key cache as [num_blocks, block_size, num_kv_heads, head_dim] rows. The cache
    stores each block's keys transposed in 32-bit lanes (a float, or a pair of bf16 dimensions):
    [num_kv_heads, head_dim / P, block_size, P] under the same shape, so that decodes and
    prefill tiles read a vector of positions at a time (``paged_attention.cpp``). A view for
    float32, a copy for bf16."""
    blocks, block_size, kv_heads, head_dim = k_cache.shape
    rows = _lane_view(k_cache).permute(0, 3, 1, 2, 4)
    return rows.reshape(blocks, block_size, kv_heads, head_dim)


def keys_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """A key cache in the kernel's layout holding ``rows`` ([num_blocks, block_size,
    num_kv_heads, head_dim]): ``keys_as_rows``' inverse."""
    blocks, block_size, kv_heads, head_dim = rows.shape
    per_lane = 4 // rows.element_size()
    lanes = rows.reshape(blocks, block_size, kv_heads, head_dim // per_lane, per_lane)
    return lanes.permute(0, 2, 3, 1, 4).contiguous().view(rows.shape)


def kernel_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], heads packed; rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (keys_as_rows)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [T] int32: positions token t attends, its own included
    scale: float,
    token_seqs: torch.Tensor | None = None,  # [T] int32 row of block_tables; None: token t -> t
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Returns [T, num_heads * head_dim], written into ``out`` when it is a contiguous tensor
    of that shape and q's dtype.

    ``new_kv = (k, v, slot_mapping)``: this step's keys and values ([T, kv_heads, head_dim] in q's
    dtype, heads packed, rows may be strided) are first written to the cache rows
    ``slot_mapping`` ([T] int64), rounded to the cache's dtype, in the same call.

    ``window``: a token at position p attends to positions (p - window, p] only (a sliding-window
    layer); the blocks of its table that lie wholly before that range are never read, so their
    entries may name freed or reused blocks. None: its whole context."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the paged attention kernel is not available")
    shape = (q.shape[0], q.shape[1] * q.shape[2])
    if out is None or out.shape != shape or out.dtype != q.dtype or not out.is_contiguous():
        out = torch.empty(shape, dtype=q.dtype)
    k, v, slots = new_kv if new_kv is not None else (None, None, None)
    ops.paged_attention(q, k_cache, v_cache, block_tables, context_lens, token_seqs, scale, out,
                        k, v, slots, window or 0)
    return out
