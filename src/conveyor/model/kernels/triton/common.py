"""What every Triton kernel launcher needs: whether Triton is importable, whether it runs in
its interpreter, and the dtype the kernels feed ``tl.dot``."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs kernels on CPU tensors with numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype):
    """The element type the kernels give ``tl.dot``: the tensors' own 16-bit type on a GPU
    (tensor cores); float32 in the interpreter, whose numpy matmul takes bf16 operands as their
    raw uint16 bits."""
    import triton.language as tl

    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact float32 products (``"ieee"``), not TF32's 10-bit mantissas;
    16-bit operands multiply exactly either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} differ")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(0) != k_cache.stride(1) * k_cache.shape[1]:
        raise ValueError("k_cache and v_cache must hold [num_blocks, block_size, ...] rows "
                         "with blocks contiguous")


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> tuple[int, int]:
    """Checks q [tokens, num_heads, head_dim] against the caches [num_blocks, block_size,
    num_kv_heads, head_dim]; returns (block_size, num_kv_heads)."""
    check_cache(k_cache, v_cache)
    _, block_size, kv_heads, _ = k_cache.shape
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads do not split over {kv_heads} KV heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be contiguous in q and the caches")
    return block_size, kv_heads
