"""Write a step's new K and V rows into the paged cache, one program per token: token ``t``
goes to flat slot ``slot_mapping[t]`` (block * block_size + offset); a negative slot (a padded
row of a CUDA-graph batch) is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.model.kernels.triton.common import check_cache


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_slot, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        dst = slot * stride_slot + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k``, ``v``: [T, num_kv_heads, head_dim] (rows may be strided, head_dim contiguous);
    caches [num_blocks, block_size, num_kv_heads, head_dim]; ``slot_mapping``: [T] integers."""
    check_cache(k_cache, v_cache)
    num_tokens, kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be contiguous in k, v and the caches")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
