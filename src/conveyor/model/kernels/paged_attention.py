"""Paged attention on the CPU, decodes and prefill chunks: the C++ kernel of
``paged_attention.cpp`` via ctypes.

``attention_kernel_available()`` builds the kernel on first use (see ``build.py``) and says
whether it can run here; ``CONVEYOR_KERNELS=off`` turns it off (``layers/attention.py`` then
takes its ``scaled_dot_product_attention`` path).
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_function
from conveyor.model.kernels.fused_ops import packed_heads

# (queries' dtype, cache's dtype) -> symbol
_SYMBOLS = {(torch.float32, torch.float32): "paged_attention_f32",
            (torch.bfloat16, torch.bfloat16): "paged_attention_bf16",
            (torch.float32, torch.bfloat16): "paged_attention_f32_bf16_cache"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 4 + [_P, _I, _P, _I, _P] + [_P] * 3 + [_I] * 7 + [ctypes.c_float, ctypes.c_int]


def _kernel(dtype: torch.dtype, cache_dtype: torch.dtype, deterministic: bool = False):
    symbol = _SYMBOLS.get((dtype, cache_dtype))
    if symbol is None:
        return None
    if deterministic:
        symbol += "_deterministic"
    return kernel_function("paged_attention.cpp", symbol, _ARGTYPES)


def attention_kernel_available(device: torch.device, dtype: torch.dtype,
                               cache_dtype: torch.dtype | None = None) -> bool:
    """For queries of ``dtype`` over a cache of ``cache_dtype`` (default: the same)."""
    return device.type == "cpu" and _kernel(dtype, cache_dtype or dtype) is not None


def kernel_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], heads packed; rows may be strided
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [T] int32: positions token t attends, its own included
    scale: float,
    token_seqs: torch.Tensor | None = None,  # [T] int32 row of block_tables; None: token t -> t
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Returns [T, num_heads * head_dim], written into ``out`` when it is a contiguous tensor
    of that shape and q's dtype.

    ``new_kv = (k, v, slot_mapping)``: this step's keys and values ([T, kv_heads, head_dim] in q's
    dtype, heads packed, rows may be strided) are first written to the cache rows
    ``slot_mapping`` ([T] int64), rounded to the cache's dtype, in the same call.

    ``deterministic``: every query row takes one arithmetic (the one-token path; bf16 over an
    odd block size, the tiles), so that a token's output does not depend on whether it is a
    decode or part of a chunk, nor on the chunk's boundaries (docs/determinism.md); otherwise
    chunks of 8 tokens or more go in the faster tiles."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    kernel = _kernel(q.dtype, k_cache.dtype, deterministic)
    if kernel is None:
        raise RuntimeError(f"the paged attention kernel is not available for {q.dtype} "
                           f"queries over a {k_cache.dtype} cache")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not packed_heads(q):
        q = q.contiguous()
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "context_lens": context_lens}
    if token_seqs is not None:
        tensors["token_seqs"] = token_seqs
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if name not in ("k_cache", "v_cache") and t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32")
    if token_seqs is None and block_tables.shape[0] < num_tokens:
        raise ValueError("without token_seqs, block_tables needs a row per token")
    if context_lens.shape != (num_tokens,) or (token_seqs is not None
                                               and token_seqs.shape != (num_tokens,)):
        raise ValueError("context_lens and token_seqs need one entry per token")
    k = v = slots = None
    if new_kv is not None:
        k, v, slots = new_kv
        for name, t in (("k", k), ("v", v)):
            if (t.shape != (num_tokens, num_kv_heads, head_dim) or t.dtype != q.dtype
                    or not packed_heads(t)):
                raise ValueError(f"new {name} must be [{num_tokens}, {num_kv_heads}, {head_dim}] "
                                 f"{q.dtype} with packed heads")
        if slots.shape != (num_tokens,) or slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError("slot_mapping must be a contiguous int64 entry per token")
    shape = (num_tokens, num_heads * head_dim)
    if out is None or out.shape != shape or out.dtype != q.dtype or not out.is_contiguous():
        out = torch.empty(shape, dtype=q.dtype)
    kernel(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        None if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
        None if v is None else v.data_ptr(), 0 if v is None else v.stride(0),
        None if slots is None else slots.data_ptr(),
        block_tables.data_ptr(), None if token_seqs is None else token_seqs.data_ptr(),
        context_lens.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, block_size,
        block_tables.shape[1], q.stride(0), scale, torch.get_num_threads())
    return out
