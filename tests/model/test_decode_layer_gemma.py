"""The one-call decode layers (kernels/decode_layer.cpp) for Gemma 3's layers and for Llama layers
with per-head q/k norms (Qwen3's), against the layers' Python path: the same hidden state,
residual stream and KV caches, bit for bit (docs/determinism.md: which path runs depends on the
batch size, and results must not), in float32 and bf16, deterministic or not, for 1 to 40 rows.

The Gemma model is tiny and random, with sliding-window and global layers (each kind its rotary),
an attention scale of its own and contexts longer than the window, on a hybrid KV cache: the
sliding layers' KV-cache group has its own block tables, whose entries before the window name a
block of NaNs (so a layer that read them would return NaN)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import conveyor.model.llama as llama
from conveyor.model.backends.cpu_kernels import CpuBackend
from conveyor.model.config import ModelConfig
from conveyor.model.device import KernelPlan
from conveyor.model.fused_decode import decode_weights, fuse_decode_layers
from conveyor.model.gemma3 import LOCAL_ROTARY, Gemma3DecoderLayer
from conveyor.model.kernels.decode_layer import DecodeLayers, decode_layer_available, decode_layers
from conveyor.model.kernels.paged_attention import attention_kernel_available
from conveyor.model.kernels.panel_gemm import block_panel_gemm_available, panel_gemm_available
from conveyor.model.layers.formats import linear_format
from conveyor.model.layers.gguf_blocks import Q5_0, Q5_1, Q6_K, Q8_0
from conveyor.model.layers.linear import DenseMethod, PanelMethod
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM
from conveyor.model.registry import GEMMA3, architecture
from gguf_blocks import load_blocks, near_q4_0_blocks, raw_blocks

pytestmark = pytest.mark.skipif(
    not (decode_layer_available() and attention_kernel_available(torch.device("cpu"), torch.float32)),
    reason="the C++ kernels cannot be built here")

WINDOW, BLOCK = 20, 8
# Three layers a kind's period: two sliding-window layers, then a global one (layers 2 and 5).
GEMMA = ModelConfig(name="tiny-gemma", architecture="gemma3", num_layers=6, hidden_size=128,
                    intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                    vocab_size=100, max_position_embeddings=512, rms_norm_eps=1e-6,
                    qk_norm=True, rope_theta=1e6, rope_local_theta=10_000.0,
                    query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                    sliding_window=WINDOW, sliding_window_pattern=3, tie_word_embeddings=True)
QWEN3 = dataclasses.replace(GEMMA, name="tiny-qwen3", architecture="qwen3", num_layers=2,
                            sliding_window=0, sliding_window_pattern=0,
                            query_pre_attn_scalar=None, hidden_activation="silu",
                            tie_word_embeddings=False)
BACKEND = CpuBackend(torch.device("cpu"), attention_kernel=True)
POISON = -1  # the cache block of NaNs that a sliding group's entries before its window name


def quantize(layer: DecoderLayer, seed: int, dtype: torch.dtype, large: str | None,
             deterministic: bool) -> DecoderLayer:
    """``layer`` with random norms and random 4-bit blocks (``large``: what serves more rows than
    they do, as in test_decode_layer.py: the dense weight (None), "panels", "int8"), or with
    ``large="gguf"`` GGUF bytes (``QuantPanels``, panels above them): q, k, v of three types as
    in Gemma 3 270M's file, a K-quant down projection (the others' 128 inputs are too few for
    K-quants' blocks of 256)."""
    g = torch.Generator().manual_seed(seed)
    for norm in (m for m in layer.modules() if m is not layer and hasattr(m, "eps")):
        norm.weight.data = 1 + 0.1 * torch.randn(norm.weight.shape, generator=g)
    kinds = {"q_proj": Q5_0, "k_proj": Q5_1, "v_proj": Q8_0, None: Q5_1, "gate_proj": Q5_0,
             "up_proj": Q5_1}
    for linear in layer.projections:
        if large == "gguf":
            for name, (start, stop) in linear.shards.items():
                kind = Q6_K if linear is layer.down_proj else kinds[name]
                blocks = raw_blocks(kind, stop - start, linear.in_features, g)
                linear.load("weight", name, None, blocks)
            continue
        load_blocks(linear, near_q4_0_blocks(linear.out_features, linear.in_features, g))
    layer.to(dtype)
    dense = large in (None, "int8")
    kernels = KernelPlan(linear=DenseMethod if dense else PanelMethod, block_weights=True,
                         int8_blocks=large == "int8", backend=BACKEND,
                         deterministic=deterministic)
    for linear in layer.projections:
        linear.process_weights_after_loading(partial(linear_format, kernels, dtype))
    return layer


def tiny_model(cfg: ModelConfig, dtype: torch.dtype, large: str | None,
               deterministic: bool) -> LlamaForCausalLM:
    """``cfg``'s model (Gemma 3's or Llama's class) with quantized random layers and its fused
    decode layers (None where they cannot be built here)."""
    model = architecture(cfg.architecture).module_class()(cfg, BACKEND)
    g = torch.Generator().manual_seed(7)
    model.embed_tokens.load("weight", None, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    if cfg.tie_word_embeddings:
        model.lm_head.set_method(DenseMethod(model.embed_tokens.weight))
    else:
        model.lm_head.load("weight", None, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    model.to(dtype)
    model.layers = torch.nn.ModuleList(  # built in float32, loaded, then cast and packed
        quantize(model.make_layer(cfg, i), i, dtype, large, deterministic)
        for i in range(cfg.num_layers))
    model.fused_decode = fuse_decode_layers(model)
    return model


@dataclasses.dataclass
class Step:
    x: torch.Tensor
    residual: torch.Tensor
    positions: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: object


def decode_step(model: LlamaForCausalLM, num_seqs: int, dtype: torch.dtype,
                seed: int = 1) -> Step:
    """One decode step of ``num_seqs`` sequences with cached contexts of 1 to 70 tokens (the
    first longer than two windows), each layer's cache random. A model with sliding layers gets a
    hybrid cache: the global layers' group (group 0) and the sliding layers' each have their own
    tables over one block pool, and the runner's per-layer metadata."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    contexts = [(37 * i + 45) % 70 + 1 for i in range(num_seqs)]
    hybrid = any(layer.window for layer in model.layers)
    nxt, groups = 0, [[] for _ in range(2 if hybrid else 1)]
    for c in contexts:
        need = c // BLOCK + 1
        for gi, tables in enumerate(groups):
            row = list(range(nxt, nxt + need))[::-1]  # scattered blocks
            nxt += need
            if gi == 1:  # wholly before the new token's window (the last WINDOW positions up
                # to position c): never read (freed in a real hybrid cache)
                skipped = max(0, c + 1 - WINDOW) // BLOCK
                row[:skipped] = [POISON] * skipped
            tables.append(row)
    shape = (nxt + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = []
    for layer in model.layers:
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        if layer.window:
            k[POISON], v[POISON] = float("nan"), float("nan")
        caches.append((k, v))
    for tables in groups:  # POISON as the block index it is
        for row in tables:
            row[:] = [b % shape[0] for b in row]
    backend = CpuBackend(torch.device("cpu"), attention_kernel=True)
    metas = [backend.build_metadata(tables, contexts, [1] * num_seqs, BLOCK,
                                    cfg.num_queries_per_kv, dtype) for tables in groups]
    meta = metas[0]
    if hybrid:
        meta.layer_metadata = [metas[1] if layer.window else metas[0] for layer in model.layers]
    x = torch.randn(num_seqs, cfg.hidden_size, generator=g).to(dtype)
    residual = torch.randn(num_seqs, cfg.hidden_size, generator=g).to(dtype)
    return Step(x, residual, meta.positions, caches, meta)


def run_both(model: LlamaForCausalLM, step: Step, monkeypatch) -> tuple[tuple, tuple]:
    """``step`` through the model's layers (``run_layers``) in one call and on the Python path,
    each on its own copies: (hidden, residual, caches) of each, the one call's first. Asserts
    that the first went through the one call and the second did not."""
    calls = []
    monkeypatch.setattr(llama, "decode_layers", lambda *a: calls.append(1) or decode_layers(*a))
    results = []
    fused = model.fused_decode
    for use in (fused, None):
        model.fused_decode = use
        calls.clear()
        residual = step.residual.clone()
        caches = [(k.clone(), v.clone()) for k, v in step.caches]
        x = model.run_layers(step.x.clone(), residual, step.positions, caches, step.meta)
        assert bool(calls) == (use is not None)
        results.append((x, residual, caches))
    model.fused_decode = fused
    return results[0], results[1]


def assert_same(got: tuple, expected: tuple) -> None:
    (x, residual, caches), (ex, eres, ecaches) = got, expected
    assert not ex.isnan().any()
    assert torch.equal(x, ex) and torch.equal(residual, eres)
    for (k, v), (ek, ev) in zip(caches, ecaches, strict=True):
        assert torch.equal(k.nan_to_num(), ek.nan_to_num())
        assert torch.equal(v.nan_to_num(), ev.nan_to_num())


def larges(dtype: torch.dtype) -> list[str | None]:
    """What may serve rows beyond the blocks here: nothing, panels, integer compute."""
    return [None] + (["panels"] if panel_gemm_available(dtype) else []) + ["int8"]


def serving(model: LlamaForCausalLM, rows: int, dtype: torch.dtype, large: str | None,
            deterministic: bool) -> None:
    """Skip where this CPU has no kernel to serve ``rows`` rows of ``large`` in one call."""
    if large not in larges(dtype) and large != "gguf":
        pytest.skip(f"no {large} GEMM for {dtype} here")
    if large == "gguf" and not panel_gemm_available(dtype):
        pytest.skip(f"no panels for {dtype} here")
    assert model.fused_decode is not None
    if not model.fused_decode.serves(rows):
        assert large is None  # only the blocks, and they serve fewer rows (or none)
        if deterministic and not block_panel_gemm_available(dtype):
            pytest.skip(f"no block panels for {dtype} here: the dense weight serves every row")
        pytest.skip(f"the blocks serve fewer than {rows} rows in {dtype}")


CASES = ([(torch.float32, n, None) for n in (1, 3, 12)]
         + [(torch.float32, n, large) for n in (13, 40) for large in ("panels", "int8")]
         + [(torch.bfloat16, n, None) for n in (1, 3, 4)]
         + [(torch.bfloat16, n, large) for n in (5, 40) for large in ("panels", "int8")]
         + [(d, n, "gguf") for d in (torch.float32, torch.bfloat16) for n in (1, 3, 13)])
DETERMINISTIC = pytest.mark.parametrize("deterministic", [False, True],
                                        ids=["fast", "deterministic"])


@pytest.mark.parametrize("dtype,num_seqs,large", CASES)
@DETERMINISTIC
def test_gemma_layers_in_one_call_equal_python_path(monkeypatch, dtype, num_seqs, large,
                                                    deterministic):
    """Six Gemma 3 layers (sliding, sliding, global, twice) on a hybrid cache."""
    model = tiny_model(GEMMA, dtype, large, deterministic)
    assert [layer.window for layer in model.layers] == [WINDOW, WINDOW, None] * 2
    assert [layer.rotary_index for layer in model.layers] == [LOCAL_ROTARY, LOCAL_ROTARY, 0] * 2
    assert all(layer.scale == 24 ** -0.5 for layer in model.layers)
    serving(model, num_seqs, dtype, large, deterministic)
    step = decode_step(model, num_seqs, dtype)
    assert step.meta.decode_only and step.meta.layer_metadata is not None
    assert step.caches[0][0].isnan().any()  # the sliding layers' poisoned block
    assert_same(*run_both(model, step, monkeypatch))


@pytest.mark.parametrize("dtype,num_seqs,large",
                         [(torch.float32, n, None) for n in (1, 5)]
                         + [(torch.bfloat16, n, None) for n in (1, 3)]
                         + [(d, 20, "panels") for d in (torch.float32, torch.bfloat16)])
@DETERMINISTIC
def test_qk_norm_llama_layers_in_one_call_equal_python_path(monkeypatch, dtype, num_seqs,
                                                            large, deterministic):
    """Two Llama layers with per-head q/k norms (Qwen3's), on one KV-cache group."""
    model = tiny_model(QWEN3, dtype, large, deterministic)
    assert type(model.layers[0]) is DecoderLayer and model.layers[0].q_norm is not None
    weights = decode_weights(model.layers[0], architecture("qwen3").decode_layer)
    assert weights.q_norm is model.layers[0].q_norm.weight and weights.activation == "silu"
    assert weights.post_attention_norm is None and weights.scale is None
    serving(model, num_seqs, dtype, large, deterministic)
    step = decode_step(model, num_seqs, dtype)
    assert step.meta.layer_metadata is None
    assert_same(*run_both(model, step, monkeypatch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_logits_in_one_call_equal_python_path(monkeypatch, dtype):
    """The whole forward (the embedding's scale and the logits outside the layers): the same
    logits, and a prefill step (not every token a decode) stays on the Python path."""
    large = "panels" if panel_gemm_available(dtype) else "int8"
    model = tiny_model(dataclasses.replace(GEMMA, final_logit_softcapping=30.0), dtype, large,
                       True)
    step = decode_step(model, 6, dtype)
    ids = torch.arange(6) * 7 % GEMMA.vocab_size
    calls = []
    monkeypatch.setattr(llama, "decode_layers", lambda *a: calls.append(1) or decode_layers(*a))
    logits, fused = [], model.fused_decode
    for use in (fused, None):
        model.fused_decode = use
        calls.clear()
        caches = [(k.clone(), v.clone()) for k, v in step.caches]
        logits.append(model(ids, step.positions, caches, step.meta, torch.arange(6)))
        assert bool(calls) == (use is not None)
    model.fused_decode = fused
    assert not logits[1].isnan().any() and torch.equal(logits[0], logits[1])

    backend = CpuBackend(torch.device("cpu"), attention_kernel=True)
    prefill = backend.build_metadata([[0, 1]], [0], [5], BLOCK, GEMMA.num_queries_per_kv, dtype)
    assert not prefill.decode_only
    calls.clear()
    caches = [(k.clone(), v.clone()) for k, v in step.caches]
    model(torch.arange(5), prefill.positions, caches, prefill, torch.tensor([4]))
    assert not calls


def test_which_layers_fuse():
    """Gemma 3's and q/k-norm layers give their extras; a layer whose norms differ in eps, or a
    projection without blocks, keeps the model on the Python path."""
    gemma = tiny_model(GEMMA, torch.float32, "int8", False)
    weights = [decode_weights(layer, GEMMA3.decode_layer) for layer in gemma.layers]
    assert [w.window for w in weights] == [WINDOW, WINDOW, 0] * 2
    assert [w.rotary for w in weights] == [LOCAL_ROTARY, LOCAL_ROTARY, 0] * 2
    w = weights[0]
    layer = gemma.layers[0]
    assert (w.activation, w.scale) == ("gelu_tanh", 24 ** -0.5)
    assert w.post_attention_norm is layer.post_attention_norm.weight
    assert w.post_feedforward_norm is layer.post_feedforward_norm.weight
    assert w.k_norm is layer.k_norm.weight
    assert gemma.fused_decode is not None and gemma.fused_decode.num_layers == 6
    layer.k_norm.eps = 1e-5
    assert decode_weights(layer, GEMMA3.decode_layer) is None and fuse_decode_layers(gemma) is None
    dense = Gemma3DecoderLayer(GEMMA, BACKEND, 0)  # dense weights: no blocks
    for p in dense.projections:
        for name, (start, stop) in p.shards.items():
            p.load("weight", name, torch.zeros(stop - start, p.in_features))
    assert decode_weights(dense, GEMMA3.decode_layer) is None
    # Sizes the kernel refuses are refused with the argument named, as for Llama's layers.
    bad = dataclasses.replace(weights[1], q_norm=weights[1].q_norm[:16])
    with pytest.raises(RuntimeError, match=r"q_norm must have shape \[32\]"):
        DecodeLayers([bad])
    bad = dataclasses.replace(weights[1], activation="gelu")
    with pytest.raises(RuntimeError, match='activation must be "silu" or "gelu_tanh"'):
        DecodeLayers([bad])


def test_rotary_tables_per_layer_kind(monkeypatch):
    """Each layer takes its kind's table: swapping the tables changes the result of the layers
    that read them (the sliding ones), as on the Python path."""
    model = tiny_model(GEMMA, torch.float32, "int8", False)
    step = decode_step(model, 3, torch.float32)
    rotaries = [r.cos_sin(step.positions, torch.float32)
                for r in (model.rotary, model.local_rotary)]
    assert not torch.equal(rotaries[0][0], rotaries[1][0])
    outs = []
    for order in (rotaries, rotaries[::-1]):
        residual = step.residual.clone()
        caches = [(k.clone(), v.clone()) for k, v in step.caches]
        outs.append(model.decode_in_one_call(step.x.clone(), residual, order, caches, step.meta))
    assert not torch.equal(outs[0], outs[1])
    (x, *_), _ = run_both(model, step, monkeypatch)
    assert torch.equal(outs[0], x)

