"""Every decoder layer of a decode step in one call (``decode_layer.cpp`` via ctypes).

``DecodeLayerWeights`` holds the C struct of one layer's weight pointers, built once at load
time (it keeps the tensors alive); ``DecodeLayers`` the array of them for a whole model.
``decode_layer_available()`` builds the kernel on first use (see ``build.py``);
``CONVEYOR_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_function
from conveyor.model.kernels.int8_gemm import int8_gemm_available
from conveyor.model.layers.quantized import BlockPanels, Int8Panels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Int8Weight(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("minimum", _P), ("n_out", _I), ("exact", _P),
                ("exact_weights", _P), ("n_exact", _I)]


class _Weight(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("minimum", _P), ("panels", _P),
                ("int8", _Int8Weight), ("n_out", _I), ("max_block_rows", _I),
                ("block_panels", _I)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("hidden", _I), ("num_heads", _I),
                ("num_kv_heads", _I), ("head_dim", _I), ("intermediate", _I), ("eps", _F)]


_ARGTYPES = [_P] * 3 + [_I] + [_P] * 2 + [_I] + [_P] * 2 + [_I] + [_P] * 3 + [_I, _F, ctypes.c_int]
_SYMBOLS = {torch.float32: "decode_layers_f32", torch.bfloat16: "decode_layers_bf16"}


def _kernel(dtype: torch.dtype = torch.float32, deterministic: bool = False):
    symbol = _SYMBOLS[dtype]
    if deterministic:
        symbol = symbol.replace("decode_layers_", "decode_layers_deterministic_")
    return kernel_function("decode_layer.cpp", symbol, _ARGTYPES)


def decode_layer_available() -> bool:
    return _kernel() is not None


class DecodeLayerWeights:
    """A layer's norms (float32 or bf16: the activations' dtype) and projections, as pointers for
    ``decode_layers``: each one's 4-bit blocks (NibbleInt4 or BlockPanels: ``codes``, ``scale``,
    ``min``), which
    serve up to their ``max_tokens`` rows, and optionally what serves more: ``large``, per
    projection either its panels (``pack_panels`` in the activations' dtype) or its
    ``Int8Panels``. Without ``large`` the layer serves no more rows than the blocks."""

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, blocks: dict,
                 large: dict | None, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        large = large or {}
        norms = [input_norm, post_norm]
        int8 = [p for p in large.values() if isinstance(p, Int8Panels)]
        floats = [t for p in blocks.values() for t in (p.scale, p.min)]
        floats += [t for p in int8 for t in (p.scale, p.min)]
        codes = [p.codes for p in blocks.values()]
        packed = [p for p in large.values() if isinstance(p, torch.Tensor)]
        if (input_norm.dtype not in _SYMBOLS or post_norm.dtype != input_norm.dtype
                or any(t.dtype != torch.float32 for t in floats)
                or any(t.dtype != torch.uint8 for t in codes)
                or any(p.codes.dtype != torch.uint8 for p in int8)
                or any(t.dtype != input_norm.dtype for t in packed)
                or not all(t.is_contiguous() for t in norms + floats + codes + packed)):
            raise ValueError("decode_layers needs contiguous float32 or bf16 norms (and panels "
                             "in their dtype), float32 scales and uint8 codes")
        if int8 and not int8_gemm_available():
            raise ValueError("Int8Panels need the int8 GEMM kernel (AVX512-VNNI)")
        self.dtype = input_norm.dtype
        # None: any number of rows
        self.max_rows = None if large else min(p.max_tokens for p in blocks.values())
        # keeps the pointed-to memory alive
        self._tensors = norms + floats + codes + packed + [
            t for p in int8 for t in (p.codes, p.exact, p.exact_weights) if t is not None]

        def int8_weight(p: Int8Panels | None) -> _Int8Weight:
            if p is None:
                return _Int8Weight()
            exact = p.exact is not None
            return _Int8Weight(p.codes.data_ptr(), p.scale.data_ptr(), p.min.data_ptr(), p.n_out,
                               p.exact.data_ptr() if exact else None,
                               p.exact_weights.data_ptr() if exact else None,
                               p.exact.numel() if exact else 0)

        def weight(name: str) -> _Weight:
            p, big = blocks[name], large.get(name)
            return _Weight(p.codes.data_ptr(), p.scale.data_ptr(), p.min.data_ptr(),
                           big.data_ptr() if isinstance(big, torch.Tensor) else None,
                           int8_weight(big if isinstance(big, Int8Panels) else None),
                           p.codes.shape[0], p.max_tokens, isinstance(p, BlockPanels))

        self.struct = _LayerWeights(
            input_norm.data_ptr(), post_norm.data_ptr(),
            *(weight(n) for n in ("qkv", "o", "gate_up", "down")),
            input_norm.shape[0], num_heads, num_kv_heads, head_dim,
            blocks["gate_up"].codes.shape[0] // 2, eps)
        self.scale = head_dim ** -0.5


class DecodeLayers:
    """The pointer array of a model's ``DecodeLayerWeights``, in layer order, and the most rows
    (decode tokens) they serve: None for any number."""

    def __init__(self, layers: list[DecodeLayerWeights]) -> None:
        self.layers = layers  # keeps the structs alive
        self.array = (ctypes.c_void_p * len(layers))(
            *[ctypes.addressof(w.struct) for w in layers])
        self.scale = layers[0].scale
        self.dtype = layers[0].dtype
        if any(w.dtype != self.dtype for w in layers):
            raise ValueError("every layer's norms must have one dtype")
        limits = [w.max_rows for w in layers if w.max_rows is not None]
        self.max_rows = min(limits) if limits else None

    def serves(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


def decode_layers(weights: DecodeLayers, x: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor,
                  kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  deterministic: bool = False) -> torch.Tensor:
    """Runs every layer on ``x`` [T, hidden] (one decode token per row) and returns the last
    layer's output, written over ``x``; ``residual`` is updated in place and each layer's K/V
    are written to their slots, as the Python path does. Every tensor but the index ones is in
    the layers' dtype. ``deterministic``: attention as ``kernel_attention`` computes it so."""
    dtype = weights.dtype
    kernel = _kernel(dtype, deterministic)
    if kernel is None:
        raise RuntimeError("the decode layer kernel is not available")
    if len(kv_caches) != len(weights.layers):
        raise ValueError(f"{len(weights.layers)} layers but {len(kv_caches)} KV caches")
    for name, t in (("x", x), ("residual", residual), ("cos", cos), ("sin", sin)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype}")
    if any(c.dtype != dtype or not c.is_contiguous() for kv in kv_caches for c in kv):
        raise ValueError(f"the KV caches must be contiguous {dtype}")
    if (slot_mapping.dtype != torch.int64 or block_tables.dtype != torch.int32
            or context_lens.dtype != torch.int32):
        raise ValueError("slot_mapping must be int64, block_tables and context_lens int32")
    k_ptrs = (ctypes.c_void_p * len(kv_caches))(*[k.data_ptr() for k, _ in kv_caches])
    v_ptrs = (ctypes.c_void_p * len(kv_caches))(*[v.data_ptr() for _, v in kv_caches])
    kernel(weights.array, k_ptrs, v_ptrs, len(kv_caches), x.data_ptr(), residual.data_ptr(),
           x.shape[0], cos.data_ptr(), sin.data_ptr(), kv_caches[0][0].shape[1],
           slot_mapping.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
           block_tables.shape[1], weights.scale, torch.get_num_threads())
    return x
