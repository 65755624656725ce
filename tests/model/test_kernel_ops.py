"""Every kernel operator refuses a wrong dtype, a non-contiguous tensor and a wrong shape with a
RuntimeError naming the argument, before any pointer is touched (never an abort, never a
silent read or write out of bounds)."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.kernels.build import kernel_features, kernel_ops
from conveyor.model.kernels.panel_gemm import pack_panels
from conveyor.model.layers.quantized import (
    GROUP,
    BlockPanels,
    Int4Blocks,
    Int8Blocks,
    NibbleInt4,
)

ops = kernel_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ compiler: the torch path runs")


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a non-contiguous tensor of t's shape (every other element of a wider one)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def refuses(fn, args: dict, name: str, bad: torch.Tensor, match: str) -> None:
    with pytest.raises(RuntimeError, match=match):
        fn(**{**args, name: bad})


def blocks4(n: int = 32, k: int = 64) -> NibbleInt4:
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02
    return NibbleInt4.pack(Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8,
                                                    generator=g), scale, -8 * scale))


def block_panels4(n: int = 32, k: int = 64, dtype: torch.dtype = torch.float32) -> BlockPanels:
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02
    return BlockPanels.pack(Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8,
                                                     generator=g), scale, -8 * scale), dtype)


def test_panel_gemm() -> None:
    packed = pack_panels(torch.randn(32, 64))
    args = dict(x=torch.randn(3, 64), packed=packed, n=32)
    ops.panel_gemm(**args)
    refuses(ops.panel_gemm, args, "x", torch.randn(3, 64).double(), "x must be float32 or bfloat16")
    refuses(ops.panel_gemm, args, "packed", packed.bfloat16(), "packed must be float32, got bfloat16")
    refuses(ops.panel_gemm, args, "packed", strided(packed), "packed must be contiguous")
    refuses(ops.panel_gemm, args, "packed", packed[:, :32], "x must have 32 columns")
    refuses(ops.panel_gemm, args, "packed", packed[:, :, :packed.shape[2] // 2].contiguous(),
            "packed must have shape")
    with pytest.raises(RuntimeError, match="packed must have shape"):
        ops.panel_gemm(torch.randn(3, 64), packed, 64)  # more outputs than the panels hold


def test_block_matmul() -> None:
    w = blocks4()
    args = dict(x=torch.randn(2, 64), codes=w.codes, scale=w.scale, minimum=w.min)
    ops.block_matmul(**args)
    refuses(ops.block_matmul, args, "x", torch.randn(2, 64).half(), "x must be float32 or bfloat16")
    refuses(ops.block_matmul, args, "codes", w.codes.to(torch.int8), "codes must be uint8")
    refuses(ops.block_matmul, args, "scale", strided(w.scale), "scale must be contiguous")
    refuses(ops.block_matmul, args, "minimum", w.min[:8], r"minimum must have shape \[32, 2\]")
    refuses(ops.block_matmul, args, "x", torch.randn(2, 96), r"codes must have shape \[32, 48\]")
    with pytest.raises(RuntimeError, match="codes must be int8"):  # 8-bit blocks are signed
        ops.block_matmul(torch.randn(2, 64), w.codes, w.scale, None)


@pytest.mark.skipif("avx2" not in kernel_features(), reason="needs AVX2")
def test_block_panel_gemm() -> None:
    w = block_panels4()
    args = dict(x=torch.randn(2, 64), codes=w.codes, scale=w.scale, minimum=w.min)
    ops.block_panel_gemm(**args)
    fn = ops.block_panel_gemm
    refuses(fn, args, "x", torch.randn(2, 64).half(), "x must be float32 or bfloat16")
    refuses(fn, args, "x", torch.randn(2, 96), "x must have 64 columns")
    refuses(fn, args, "codes", w.codes.to(torch.int8), "codes must be uint8")
    refuses(fn, args, "codes", w.codes[:, :16].contiguous(), r"codes must have shape \[32, 32\]")
    refuses(fn, args, "codes", strided(w.codes), "codes must be contiguous")
    refuses(fn, args, "scale", strided(w.scale), "scale must be contiguous")
    refuses(fn, args, "scale", w.scale.double(), "scale must be float32")
    refuses(fn, args, "scale", torch.rand(8, 2), "output size of BlockPanels must be a multiple")
    refuses(fn, args, "minimum", w.min[:8], r"minimum must have shape \[32, 2\]")
    with pytest.raises(RuntimeError, match="codes must be int8"):  # 8-bit codes are signed
        fn(torch.randn(2, 64), w.codes, w.scale, None)
    g = torch.Generator().manual_seed(1)
    w8 = BlockPanels.pack(Int8Blocks(torch.randint(-128, 128, (32, 64), dtype=torch.int8,
                                                   generator=g), torch.rand(32, 2, generator=g)),
                          torch.float32)
    fn(torch.randn(2, 64), w8.codes, w8.scale, None)
    with pytest.raises(RuntimeError, match=r"minimum must have shape|codes must be uint8"):
        fn(torch.randn(2, 64), w8.codes, w8.scale, w.min)
    if "avx512bf16" in kernel_features():
        wb = block_panels4(dtype=torch.bfloat16)
        fn(torch.randn(2, 64).bfloat16(), wb.codes, wb.scale, wb.min)


def test_fused_ops() -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    args = dict(x=x, weight=w, eps=1e-5, residual=torch.randn(4, 64), out=torch.empty(4, 64))
    ops.rms_norm(**args)
    refuses(ops.rms_norm, args, "weight", w.bfloat16(), "weight must be float32, got bfloat16")
    refuses(ops.rms_norm, args, "residual", strided(torch.randn(4, 64)), "residual must be contiguous")
    refuses(ops.rms_norm, args, "out", torch.empty(4, 32), r"out must have shape \[4, 64\]")
    refuses(ops.rms_norm, args, "x", torch.randn(4, 60), "x's width must be a multiple")

    gate_up = torch.randn(3, 64)
    for fn in (ops.silu_mul, ops.gelu_tanh_mul):
        fn(gate_up)
        for bad, match in ((gate_up.long(), "gate_up must be float32 or bfloat16"),
                           (strided(gate_up), "gate_up must be contiguous"),
                           (torch.randn(64), "gate_up must be 2-D"),
                           (torch.randn(3, 40), "half of gate_up's width must be a multiple")):
            with pytest.raises(RuntimeError, match=match):
                fn(bad)

    q = torch.randn(3, 2, 32)
    cos = torch.randn(3, 1, 32)
    args = dict(x=q, cos=cos, sin=cos.clone(), out=torch.empty(3, 2, 32))
    ops.rotary(**args)
    refuses(ops.rotary, args, "cos", cos.bfloat16(), "cos must be float32, got bfloat16")
    refuses(ops.rotary, args, "sin", strided(cos), "sin must be contiguous")
    refuses(ops.rotary, args, "sin", torch.randn(2, 1, 32), "sin must have shape")
    refuses(ops.rotary, args, "x", strided(q), "x must have its heads packed")
    refuses(ops.rotary, args, "out", torch.empty(3, 2, 32).bfloat16(), "out must be float32")

    logits = torch.randn(2, 64)
    ops.argmax(logits)
    for bad, match in ((logits.int(), "x must be float32 or bfloat16"),
                       (strided(logits), "x must be contiguous"),
                       (torch.randn(2, 2, 64), "x must be a non-empty 2-D tensor")):
        with pytest.raises(RuntimeError, match=match):
            ops.argmax(bad)


def attention_args() -> dict:
    cache = torch.randn(6, 4, 2, 32)
    return dict(q=torch.randn(2, 4, 32), k_cache=cache, v_cache=cache.clone(),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                context_lens=torch.tensor([5, 8], dtype=torch.int32), token_seqs=None,
                scale=0.125, out=torch.empty(2, 128), new_k=torch.randn(2, 2, 32),
                new_v=torch.randn(2, 2, 32), slot_mapping=torch.tensor([4, 15]))


def test_paged_attention() -> None:
    args = attention_args()
    ops.paged_attention(**args)
    fn = ops.paged_attention
    refuses(fn, args, "q", args["q"].double(), "q must be float32 or bfloat16")
    refuses(fn, args, "k_cache", strided(args["k_cache"]), "k_cache must be contiguous")
    refuses(fn, args, "v_cache", args["v_cache"][:3], "v_cache must have shape")
    refuses(fn, args, "block_tables", args["block_tables"].long(), "block_tables must be int32")
    refuses(fn, args, "block_tables", args["block_tables"].T, "block_tables must be contiguous")
    refuses(fn, args, "context_lens", args["context_lens"][:1], "context_lens must have shape")
    refuses(fn, args, "token_seqs", torch.tensor([0, 2], dtype=torch.int32),
            r"token_seqs\[1\] = 2 is not a row of block_tables")
    refuses(fn, args, "out", torch.empty(2, 128).bfloat16(), "out must be float32")
    refuses(fn, args, "new_k", args["new_k"].bfloat16(), "new_k must be float32")
    refuses(fn, args, "new_v", torch.randn(2, 2, 64)[..., ::2], "new_v must have its heads packed")
    refuses(fn, args, "slot_mapping", torch.tensor([4, 24]), r"slot_mapping\[1\] = 24 is not a cache row")
    refuses(fn, args, "block_tables", torch.tensor([[0, 1], [2, 6]], dtype=torch.int32),
            r"block_tables\[1, 1\] = 6 is not a cache block")


def _projection(w, **large) -> dict:
    """add_projection's arguments for 4-bit blocks ``w`` (``NibbleInt4`` or ``BlockPanels``) and
    what serves more rows (``panels``), if anything."""
    args = dict(codes=w.codes, scale=w.scale, minimum=w.min, max_block_rows=4,
                block_panels=isinstance(w, BlockPanels), panels=None)
    return {**args, **large}


def test_decode_layers() -> None:
    hidden, heads, kv_heads, head_dim, inter = 64, 2, 1, 32, 64
    norm = torch.ones(hidden)
    layers = torch.classes.conveyor.DecodeLayers()
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
              (2 * inter, hidden), (hidden, inter)]
    projections = [_projection(blocks4(n, k)) for n, k in shapes]
    layer = dict(input_norm=norm, post_norm=norm, num_heads=heads, num_kv_heads=kv_heads,
                 head_dim=head_dim, eps=1e-5, window=0)

    def add(p: dict) -> None:
        layers.add_projection(*p.values())

    for name, bad, match in (
            ("post_norm", norm.bfloat16(), "post_norm must be float32"),
            ("post_norm", strided(norm), "post_norm must be contiguous"),
            ("num_kv_heads", 3, "num_heads must be a positive multiple of num_kv_heads")):
        with pytest.raises(RuntimeError, match=match):
            layers.add_layer(*{**layer, name: bad}.values())
    head_norm = torch.ones(head_dim)
    for extra, match in (  # what a layer may add to Llama's (Qwen3's q/k norms, Gemma 3's)
            (dict(q_norm=head_norm), "q_norm and k_norm come together"),
            (dict(q_norm=norm, k_norm=norm), r"q_norm must have shape \[32\]"),
            (dict(post_attention_norm=norm.bfloat16()), "post_attention_norm must be float32"),
            (dict(post_feedforward_norm=norm[:32]), "post_feedforward_norm must have shape"),
            (dict(activation="relu"), 'activation must be "silu" or "gelu_tanh", got "relu"'),
            (dict(scale=-1.0), "scale must be positive and finite"),
            (dict(rotary=-1), "rotary must be >= 0")):
        with pytest.raises(RuntimeError, match=match):
            layers.add_layer(*layer.values(), **extra)
    with pytest.raises(RuntimeError, match="add_layer first"):
        add(projections[0])
    layers.add_layer(*layer.values())
    with pytest.raises(RuntimeError, match="lacks projections"):
        layers.add_layer(*layer.values())
    qkv = projections[0]
    for bad, match in (
            (_projection(blocks4(hidden, heads * head_dim)), "qkv's codes must have 128 rows"),
            ({**qkv, "scale": qkv["scale"].double()}, "qkv blocks' scale must be float32"),
            ({**qkv, "panels": torch.zeros(3)}, "qkv's panels must have shape")):
        with pytest.raises(RuntimeError, match=match):
            add(bad)
    for p in projections:
        add(p)
    assert layers.num_layers() == 1 and layers.max_rows() == 4

    cache = torch.zeros(4, 4, kv_heads, head_dim)
    run = dict(weights=layers, x=torch.randn(2, hidden), residual=torch.randn(2, hidden),
               cos=[torch.ones(2, 1, head_dim)], sin=[torch.zeros(2, 1, head_dim)],
               k_caches=[cache], v_caches=[cache.clone()], slot_mapping=[torch.tensor([0, 5])],
               block_tables=[torch.tensor([[0], [1]], dtype=torch.int32)],
               context_lens=[torch.tensor([1, 2], dtype=torch.int32)])
    ops.decode_layers(**run)
    fn = ops.decode_layers
    refuses(fn, run, "x", torch.randn(2, hidden).bfloat16(), "x must be float32")
    refuses(fn, run, "residual", strided(torch.randn(2, hidden)), "residual must be contiguous")
    refuses(fn, run, "cos", [torch.ones(3, 1, head_dim)], r"cos\[0\] must have shape")
    refuses(fn, run, "sin", [], "cos and sin need one table per rotary")
    refuses(fn, run, "x", torch.randn(5, hidden), "more than the weights serve")
    with pytest.raises(RuntimeError, match=r"v_caches\[0\] must have shape"):
        fn(**{**run, "v_caches": [cache[:2].clone()]})
    with pytest.raises(RuntimeError, match="one cache per layer"):
        fn(**{**run, "k_caches": [cache, cache]})
    refuses(fn, run, "slot_mapping", [torch.tensor([0, 16])],
            "slot_mapping.1. = 16 is not a cache row")
    # KV-cache groups: one set of indices each, a group per layer
    refuses(fn, run, "context_lens", run["context_lens"] * 2, "one tensor per KV-cache group")
    two = {**run, **{k: run[k] * 2 for k in ("slot_mapping", "block_tables", "context_lens")}}
    refuses(fn, two, "layer_groups", [], "layer_groups must give each layer's KV-cache group")
    refuses(fn, two, "layer_groups", [2], r"layer_groups\[0\] = 2 is not a group \(2 groups\)")
    fn(**two, layer_groups=[1])
    refuses(fn, {**two, "layer_groups": [1]}, "block_tables",
            [two["block_tables"][0], torch.tensor([[0], [9]], dtype=torch.int32)],
            r"KV-cache group 1: block_tables\[1, 0\] = 9 is not a cache block")

    # LoRA stacks (a, b per projection) and a step's slots
    stack = lambda k: torch.zeros(3, 8, k)  # noqa: E731
    stacks = [stack(hidden), stack((heads + 2 * kv_heads) * head_dim), stack(heads * head_dim),
              stack(hidden), stack(hidden), stack(2 * inter), stack(inter), stack(hidden)]
    lora = dict(lora_slots=torch.tensor([0, 2], dtype=torch.int32), lora_widths=[8, 0, 3, 8])
    with pytest.raises(RuntimeError, match="weights holds no LoRA stacks"):
        fn(**run, **lora)
    with pytest.raises(RuntimeError, match="gate_up's b must have shape"):
        layers.set_lora(0, stacks[:5] + [stack(inter)] + stacks[6:])
    with pytest.raises(RuntimeError, match="down's a must be float32"):
        layers.set_lora(0, stacks[:6] + [stack(inter).double(), stack(hidden)])
    assert not layers.has_lora()
    layers.set_lora(0, stacks)
    fn(**run, **lora)
    refuses(fn, {**run, **lora}, "lora_slots", torch.tensor([0, 3], dtype=torch.int32),
            r"lora_slots\[1\] = 3 is not a slot")
    refuses(fn, {**run, **lora}, "lora_widths", [8, 0, 9, 8], r"lora_widths\[2\] must be in 0..8")
    refuses(fn, {**run, **lora}, "lora_widths", [8], "4 widths per layer")


def test_decode_layers_of_gemma_and_qk_norms() -> None:
    """A Gemma-style layer (q/k norms, output norms, tanh GeLU, its scale, rotary table 1) and a
    Qwen3-style one: each layer's rotary table must be one of the call's."""
    hidden, heads, kv_heads, head_dim, inter = 64, 2, 1, 32, 64
    norm, head_norm = torch.ones(hidden), torch.ones(head_dim)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
              (2 * inter, hidden), (hidden, inter)]
    layers = torch.classes.conveyor.DecodeLayers()
    layers.add_layer(norm, norm, heads, kv_heads, head_dim, 1e-6, 3, q_norm=head_norm,
                     k_norm=head_norm, post_attention_norm=norm, post_feedforward_norm=norm,
                     activation="gelu_tanh", scale=0.125, rotary=1)
    for n, k in shapes:
        layers.add_projection(*_projection(blocks4(n, k)).values())
    layers.add_layer(norm, norm, heads, kv_heads, head_dim, 1e-6, 0, q_norm=head_norm,
                     k_norm=head_norm)
    for n, k in shapes:
        layers.add_projection(*_projection(blocks4(n, k)).values())
    cache = torch.zeros(4, 4, kv_heads, head_dim)
    angles = [torch.ones(2, 1, head_dim), torch.ones(2, 1, head_dim)]
    run = dict(weights=layers, x=torch.randn(2, hidden), residual=torch.randn(2, hidden),
               cos=angles, sin=[torch.zeros(2, 1, head_dim)] * 2, k_caches=[cache, cache.clone()],
               v_caches=[cache.clone(), cache.clone()], slot_mapping=[torch.tensor([0, 5])],
               block_tables=[torch.tensor([[0], [1]], dtype=torch.int32)],
               context_lens=[torch.tensor([1, 2], dtype=torch.int32)])
    ops.decode_layers(**run)
    assert not run["x"].isnan().any()
    with pytest.raises(RuntimeError, match="layer 0 takes rotary table 1, but cos and sin hold 1"):
        ops.decode_layers(**{**run, "cos": angles[:1], "sin": run["sin"][:1]})


@pytest.mark.skipif("avx2" not in kernel_features(), reason="needs AVX2")
def test_decode_layers_block_panels() -> None:
    """BlockPanels in a DecodeLayers object are checked as BlockPanels (outputs in whole panels),
    and a decode runs over them."""
    hidden, heads, kv_heads, head_dim, inter = 64, 2, 1, 32, 64
    norm = torch.ones(hidden)
    layers = torch.classes.conveyor.DecodeLayers()
    layers.add_layer(norm, norm, heads, kv_heads, head_dim, 1e-5, 0)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
              (2 * inter, hidden), (hidden, inter)]
    projections = [_projection(block_panels4(n, k)) for n, k in shapes]
    with pytest.raises(RuntimeError, match="qkv block panels' minimum must have shape"):
        layers.add_projection(*{**projections[0],
                                "minimum": projections[0]["minimum"][:, :1]}.values())
    with pytest.raises(RuntimeError, match="qkv block panels' codes must have shape"):
        layers.add_projection(*{**projections[0],
                                "codes": projections[0]["codes"][:, :8].contiguous()}.values())
    for p in projections:
        layers.add_projection(*p.values())
    cache = torch.zeros(4, 4, kv_heads, head_dim)
    ops.decode_layers(layers, torch.randn(2, hidden), torch.randn(2, hidden),
                      [torch.ones(2, 1, head_dim)], [torch.zeros(2, 1, head_dim)], [cache],
                      [cache.clone()], [torch.tensor([0, 5])],
                      [torch.tensor([[0], [1]], dtype=torch.int32)],
                      [torch.tensor([1, 2], dtype=torch.int32)])
