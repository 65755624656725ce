"""Paged decode attention on the CPU: the C++ kernel of ``paged_decode_attention.cpp`` via ctypes.

``decode_kernel_available()`` builds the kernel on first use (see ``build.py``) and says whether
it can run here; ``CONVEYOR_KERNELS=off`` turns it off (the torch path in
``layers/attention.py`` then serves decodes too).
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_function

_SYMBOLS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_ARGTYPES = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int])


def _kernel(dtype: torch.dtype):
    if dtype not in _SYMBOLS:
        return None
    return kernel_function("paged_decode_attention.cpp", _SYMBOLS[dtype], _ARGTYPES)


def decode_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and _kernel(dtype) is not None


def paged_decode_attention(
    q: torch.Tensor,  # [S, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:
    """Returns [S, num_heads, head_dim]."""
    kernel = _kernel(q.dtype)
    if kernel is None:
        raise RuntimeError(f"the paged decode attention kernel is not available for {q.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype)
    kernel(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        q.stride(0), scale, torch.get_num_threads())
    return out
