"""The one-call decode layers (kernels/decode_layer.cpp) against the layers' Python path: same
outputs, residual stream and KV caches, bit for bit, in float32 and bf16, and used only where
they apply."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from conveyor.model.backends.cpu_kernels import CpuBackend
from conveyor.model.config import ModelConfig
from conveyor.model.device import KernelPlan
from conveyor.model.fused_decode import decode_weights, fuse_decode_layers
from conveyor.model.kernels.decode_layer import DecodeLayers, decode_layer_available, decode_layers
from conveyor.model.kernels.paged_attention import attention_kernel_available
from conveyor.model.kernels.panel_gemm import block_panel_gemm_available, panel_gemm_available
from conveyor.model.layers.formats import linear_format
from conveyor.model.layers.gguf_blocks import Q5_0, Q5_1, Q6_K, Q8_0
from conveyor.model.layers.linear import DenseMethod, PanelMethod
from conveyor.model.layers.rotary import RotaryEmbedding, rope_inv_freq
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM
from conveyor.model.registry import LLAMA
from gguf_blocks import load_blocks, near_q4_0_blocks, raw_blocks

pytestmark = pytest.mark.skipif(
    not (decode_layer_available() and attention_kernel_available(torch.device("cpu"), torch.float32)),
    reason="the C++ kernels cannot be built here")

CFG = ModelConfig(name="tiny", architecture="llama", num_layers=1, hidden_size=128,
                  intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                  vocab_size=100, max_position_embeddings=512, rms_norm_eps=1e-5)
BLOCK = 16
BACKEND = CpuBackend(torch.device("cpu"), attention_kernel=True)


def quantized_layer(seed: int = 0, dtype: torch.dtype = torch.float32,
                    large: str | None = None, deterministic: bool = False) -> DecoderLayer:
    """A layer whose weights are its random 4-bit blocks (and their dequantization), laid out
    as a GGUF checkpoint's are (``Linear.process_weights_after_loading``); ``large`` says what
    serves more rows than the blocks: the dense weight (None), "panels", or "int8": integer
    compute (``Int8BlockMethod``) serving every row; ``deterministic``: the blocks packed as for deterministic inference."""
    g = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(CFG, BACKEND)
    for norm in (layer.input_norm, layer.post_norm):
        norm.weight.data = 1 + 0.1 * torch.randn(norm.weight.shape, generator=g)
    for linear in layer.projections:
        load_blocks(linear, near_q4_0_blocks(linear.out_features, linear.in_features, g))
    layer.to(dtype)
    kernels = KernelPlan(linear=PanelMethod if large == "panels" else DenseMethod,
                         block_weights=True, int8_blocks=large == "int8", backend=BACKEND,
                         deterministic=deterministic)
    for linear in layer.projections:
        linear.process_weights_after_loading(partial(linear_format, kernels, dtype))
    return layer


def decode_step(num_seqs: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    """Inputs of one decode step of ``num_seqs`` sequences with random cached contexts."""
    g = torch.Generator().manual_seed(seed)
    contexts = [int(c) for c in torch.randint(1, 60, (num_seqs,), generator=g)]
    tables, nxt = [], 0
    for c in contexts:
        need = c // BLOCK + 1
        tables.append(list(range(nxt, nxt + need))[::-1])  # scattered blocks
        nxt += need
    shape = (nxt, BLOCK, CFG.num_kv_heads, CFG.head_dim)
    caches = (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
    backend = CpuBackend(torch.device("cpu"), attention_kernel=True)
    meta = backend.build_metadata(tables, contexts, [1] * num_seqs, BLOCK,
                                  CFG.num_queries_per_kv, dtype)
    rotary = RotaryEmbedding(rope_inv_freq(CFG.head_dim, 10000.0, None))
    cos, sin = rotary.cos_sin(meta.positions, dtype)
    x = torch.randn(num_seqs, CFG.hidden_size, generator=g).to(dtype)
    residual = torch.randn(num_seqs, CFG.hidden_size, generator=g).to(dtype)
    return x, residual, cos, sin, caches, meta


def max_rows(dtype: torch.dtype) -> int:
    """The most decode rows the 4-bit copies (and so the fused layers) serve in ``dtype``."""
    return quantized_layer(0, dtype).qkv_proj.method.max_tokens


def larges(dtype: torch.dtype) -> list[str | None]:
    """What may serve rows beyond the blocks here: nothing, panels, integer compute."""
    return [None] + (["panels"] if panel_gemm_available(dtype) else []) + ["int8"]


# Without panels up to each dtype's max_tokens, where the Python path runs the same block
# kernel; with panels or on integer compute, beyond it too, where both run the same GEMM.
@pytest.mark.parametrize("dtype,num_seqs,large",
                         [(torch.float32, n, None) for n in (1, 3, 5, 12)]
                         + [(torch.float32, n, large) for n in (13, 40)
                            for large in ("panels", "int8")]
                         + [(torch.bfloat16, n, None) for n in (1, 3, 4)]
                         + [(torch.bfloat16, n, large) for n in (5, 40)
                            for large in ("panels", "int8")])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_fused_layers_equal_python_path(dtype, num_seqs, large, deterministic):
    if large not in larges(dtype):
        pytest.skip(f"no {large} GEMM for {dtype} here")
    layers = [quantized_layer(0, dtype, large, deterministic),
              quantized_layer(1, dtype, large, deterministic)]
    fused = DecodeLayers([decode_weights(layer, LLAMA.decode_layer) for layer in layers])
    if deterministic and large is None and not block_panel_gemm_available(dtype):
        # Blocks serve a deterministic step only as BlockPanels; without them the dense
        # weight serves every row, and the fused layers none.
        assert not fused.serves(1)
        pytest.skip(f"no block panels for {dtype} here: the dense weight serves every row")
    assert fused.serves(num_seqs) and fused.serves(1000) == (large is not None)
    x, residual, cos, sin, (k, v), meta = decode_step(num_seqs, dtype=dtype)
    assert meta.decode_only
    caches = [(k.clone(), v.clone()), (k.clone() + 1, v.clone() - 1)]

    h, expected_res, expected_caches, out, res, got_caches = python_and_fused(
        layers, fused, x, residual, cos, sin, caches, meta)
    assert torch.equal(out, h) and torch.equal(res, expected_res)
    for got, expected in zip(got_caches, expected_caches, strict=True):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def python_and_fused(layers, fused, x, residual, cos, sin, caches, meta):
    """One decode step through the layers' Python path and through the one-call layers, each on
    its own copies of the residual and caches: (hidden, residual, caches) of the Python path,
    then the same of the one-call layers."""
    expected_res, expected_caches, h = residual.clone(), [(a.clone(), b.clone()) for a, b in caches], x
    for layer, (kc, vc) in zip(layers, expected_caches, strict=True):
        h = layer(h.clone(), expected_res, cos, sin, kc, vc, meta)
    res, got_caches = residual.clone(), [(a.clone(), b.clone()) for a, b in caches]
    out = decode_layers(fused, x.clone(), res, cos, sin, got_caches, meta.slot_mapping,
                        meta.block_tables, meta.context_lens)
    return h, expected_res, expected_caches, out, res, got_caches


def _tiny_model(dtype: torch.dtype = torch.float32, large: str | None = None,
                deterministic: bool = False) -> LlamaForCausalLM:
    cfg = dataclasses.replace(CFG, num_layers=2)
    model = LlamaForCausalLM(cfg, BACKEND)
    g = torch.Generator().manual_seed(7)
    model.embed_tokens.load("weight", None, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    model.lm_head.load("weight", None, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    model.to(dtype)
    model.layers = torch.nn.ModuleList([quantized_layer(0, dtype, large, deterministic),
                                        quantized_layer(1, dtype, large, deterministic)])
    return model


@pytest.mark.parametrize("dtype,large", [(d, large) for d in (torch.float32, torch.bfloat16)
                                         for large in larges(d)])
def test_fused_layers_are_used_only_where_they_apply(monkeypatch, dtype, large):
    import conveyor.model.llama as llama

    calls = []
    real = llama.decode_layers
    monkeypatch.setattr(llama, "decode_layers", lambda *a: calls.append(1) or real(*a))
    model = _tiny_model(dtype, large)
    model.fused_decode = fuse_decode_layers(model)
    assert model.fused_decode is not None
    most = max_rows(dtype)
    # As far as the 4-bit copies serve; with panels or on integer compute, any decode step.
    for num_seqs, used in ((most, True), (most + 1, large is not None), (30, large is not None)):
        x, residual, cos, sin, (k, v), meta = decode_step(num_seqs, dtype=dtype)
        ids = torch.arange(num_seqs) % CFG.vocab_size
        logits, fused = [], model.fused_decode
        for use in (fused, None):  # then the Python path, for reference
            model.fused_decode = use
            calls.clear()
            caches = [(k.clone(), v.clone()) for _ in model.layers]
            logits.append(model(ids, meta.positions, caches, meta, torch.arange(num_seqs)))
            assert bool(calls) == (used and use is not None)
        model.fused_decode = fused
        assert torch.equal(logits[0], logits[1])

    bias = quantized_layer()
    bias.qkv_proj.bias = torch.nn.Parameter(torch.zeros(bias.qkv_proj.out_features))
    assert decode_weights(bias, LLAMA.decode_layer) is None  # Qwen2-style QKV bias
    dense = quantized_layer()
    dense.o_proj.set_method(dense.o_proj.method.large)
    assert decode_weights(dense, LLAMA.decode_layer) is None
    partly = _tiny_model()
    partly.layers[1] = dense
    assert fuse_decode_layers(partly) is None


def _adapter(cfg: ModelConfig, rank: int, modules: tuple[str, ...], seed: int):
    """PEFT-shaped A [r, in] and B [out, r] per (layer, module)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv),
              "v_proj": (cfg.hidden_size, kv), "o_proj": (q, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    return {(i, m): (torch.randn(rank, shapes[m][0], generator=g) * 0.1,
                     torch.randn(shapes[m][1], rank, generator=g) * 0.1)
            for i in range(cfg.num_layers) for m in modules}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_fused_layers_add_lora_as_the_python_path(monkeypatch, dtype, deterministic):
    """A decode step whose rows run under two adapters and the base model gives the Python path's
    logits bit for bit through the one-call layers, also after a wider adapter is loaded."""
    import conveyor.model.llama as llama

    large = "panels" if panel_gemm_available(dtype) else None
    model = _tiny_model(dtype, large, deterministic)
    model.fused_decode = fuse_decode_layers(model)
    if not model.fused_decode.serves(5):
        pytest.skip(f"no block panels for {dtype} here: the fused layers serve no rows")
    calls = []
    real = llama.decode_layers
    monkeypatch.setattr(llama, "decode_layers", lambda *a: calls.append(1) or real(*a))
    cfg = model.config
    model.enable_lora(num_slots=2, max_rank=8)
    model.set_lora_slot(1, _adapter(cfg, 4, ("q_proj", "v_proj", "down_proj"), 1), 2.0)
    model.set_lora_slot(2, _adapter(cfg, 2, ("k_proj", "o_proj", "gate_proj", "up_proj"), 2), 0.5)
    x, residual, cos, sin, (k, v), meta = decode_step(5, dtype=dtype)
    ids = torch.arange(5) % cfg.vocab_size

    def logits(use_fused: bool, slots: list[int]) -> torch.Tensor:
        fused = model.fused_decode
        model.fused_decode = fused if use_fused else None
        model.lora.set_slots(slots, torch.device("cpu"))
        calls.clear()
        out = model(ids, meta.positions, [(k.clone(), v.clone()) for _ in model.layers], meta,
                    torch.arange(5))
        model.fused_decode = fused
        assert bool(calls) == use_fused
        return out

    slots = [1, 0, 2, 2, 1]
    base = logits(True, [0] * 5)
    got = logits(True, slots)
    assert torch.equal(got, logits(False, slots))
    assert torch.equal(got[1], base[1]) and not torch.equal(got[0], base[0])
    model.set_lora_slot(2, _adapter(cfg, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"),
                                    3), 1.0)  # widths grow: q/k/v to 24 rows
    got = logits(True, slots)
    assert torch.equal(got, logits(False, slots)) and torch.equal(got[1], base[1])


def gguf_layer(seed: int, dtype: torch.dtype, deterministic: bool) -> DecoderLayer:
    """A layer whose projections are GGUF bytes of several types (``QuantPanels``): q, k, v of
    three types, a Q6_K down projection, panels above the blocks' rows."""
    g = torch.Generator().manual_seed(seed)
    layer = DecoderLayer(CFG, BACKEND)
    for norm in (layer.input_norm, layer.post_norm):
        norm.weight.data = 1 + 0.1 * torch.randn(norm.weight.shape, generator=g)
    kinds = {"q_proj": Q5_0, "k_proj": Q5_1, "v_proj": Q8_0, None: Q5_1, "gate_proj": Q5_0,
             "up_proj": Q5_0}
    for linear in layer.projections:
        for name, (start, stop) in linear.shards.items():
            kind = Q6_K if linear is layer.down_proj else kinds[name]
            blocks = raw_blocks(kind, stop - start, linear.in_features, g)
            linear.load("weight", name, None, blocks)
    layer.to(dtype)
    kernels = KernelPlan(linear=PanelMethod, block_weights=True, int8_blocks=False,
                         backend=BACKEND, deterministic=deterministic)
    for linear in layer.projections:
        linear.process_weights_after_loading(partial(linear_format, kernels, dtype))
    return layer


@pytest.mark.parametrize("dtype", [d for d in (torch.float32, torch.bfloat16)
                                   if panel_gemm_available(d)])
@pytest.mark.parametrize("num_seqs", [1, 3, 13])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_fused_layers_take_quant_panels(dtype, num_seqs, deterministic):
    layers = [gguf_layer(0, dtype, deterministic), gguf_layer(1, dtype, deterministic)]
    assert [p.kind for p in layers[0].qkv_proj.method.small.parts] == [Q5_0, Q5_1, Q8_0]
    fused = DecodeLayers([decode_weights(layer, LLAMA.decode_layer) for layer in layers])
    assert fused.serves(num_seqs)
    x, residual, cos, sin, (k, v), meta = decode_step(num_seqs, dtype=dtype)
    caches = [(k.clone(), v.clone()), (k.clone() + 1, v.clone() - 1)]
    h, expected_res, expected_caches, out, res, got_caches = python_and_fused(
        layers, fused, x, residual, cos, sin, caches, meta)
    assert torch.equal(out, h) and torch.equal(res, expected_res)
    for got, expected in zip(got_caches, expected_caches, strict=True):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    weights = decode_weights(layers[0], LLAMA.decode_layer)
    weights.projections[0] = dataclasses.replace(weights.projections[0], panels=None)
    with pytest.raises(RuntimeError, match="qkv's part 1 codes must have shape"):
        bad = weights.projections[0].blocks
        bad.parts[1], saved = dataclasses.replace(bad.parts[1], codes=bad.parts[1].codes[:, :8].contiguous()), bad.parts[1]
        try:
            DecodeLayers([weights])
        finally:
            bad.parts[1] = saved

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_fused_layers_take_each_layers_window(dtype, deterministic):
    """A layer with a sliding window (here the first of two) attends through it in the one-call
    layers as in the Python path, bit for bit, and neither reads the blocks before the window
    (NaN in that layer's cache)."""
    window = 9
    layers = [quantized_layer(0, dtype, None, deterministic),
              quantized_layer(1, dtype, None, deterministic)]
    layers[0].window = window
    weights = [decode_weights(layer, LLAMA.decode_layer) for layer in layers]
    assert [w.window for w in weights] == [window, 0]
    fused = DecodeLayers(weights)
    if not fused.serves(3):
        pytest.skip(f"no block panels for {dtype} here: the fused layers serve no rows")
    x, residual, cos, sin, (k, v), meta = decode_step(3, dtype=dtype)
    k0, v0 = k.clone(), v.clone()
    for row, ctx in zip(meta.block_tables.tolist(), meta.context_lens.tolist(), strict=True):
        for b in row[:max(0, ctx - window) // BLOCK]:  # wholly before the window
            k0[b], v0[b] = float("nan"), float("nan")
    caches = [(k0, v0), (k.clone() + 1, v.clone() - 1)]
    assert any(k0.isnan().flatten(1).all(1))

    h, expected_res, expected_caches, out, res, got_caches = python_and_fused(
        layers, fused, x, residual, cos, sin, caches, meta)
    assert not h.isnan().any()
    assert torch.equal(out, h) and torch.equal(res, expected_res)
