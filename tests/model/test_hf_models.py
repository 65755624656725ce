"""Tiny random Llama / Qwen2 / Qwen3 / Gemma 3 built with transformers, loaded by Conveyor: same
logits (Gemma 3's with a window of 8 that the 37- and 42-token sequences cross, a global layer
with linear rope scaling, an attention scale of its own and capped logits)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conveyor.executor.model_executor import ModelExecutor
from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.device import select_kernels
from conveyor.model.kv_cache import KVCache
from tiny_models import VOCAB, save_tiny_causal_lm


def metadata(ex: ModelExecutor, tables: list[list[int]], starts: list[int], counts: list[int],
             block_size: int, num_queries_per_kv: int, device: torch.device,
             attention_kernel: bool = False):
    """The step's metadata from the model's backend (its attention kernel), or from
    ``TorchBackend`` (scaled_dot_product_attention, which every backend's attention runs)."""
    backend = ex.model.backend if attention_kernel else TorchBackend(device)
    return backend.build_metadata(tables, starts, counts, block_size, num_queries_per_kv,
                                  ex.dtype)


@pytest.mark.parametrize("attention_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3", "gemma3"])
def test_logits_match_transformers(kind: str, attention_kernel: bool, tmp_path) -> None:
    ref = save_tiny_causal_lm(kind, str(tmp_path))
    ex = ModelExecutor(str(tmp_path), dtype="float32", device="cpu")
    cfg = ex.model_config
    if attention_kernel and not getattr(ex.model.backend, "attention_kernel", False):
        pytest.skip("the attention kernel does not run this head size / machine")
    assert cfg.architecture == kind.split("_")[0]
    assert cfg.num_params == sum(p.numel() for p in ref.parameters())

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (37, 1, 20)]
    with torch.no_grad():
        expected = [ref(torch.tensor([p])).logits[0] for p in prompts]

    # Whole prompts, all positions' logits, three sequences in one forward (one is 1 token long).
    block_size = 8
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, 32, 0,
                    torch.float32, torch.device("cpu"))
    tables = [[0, 1, 2, 3, 4, 9], [5], [6, 7, 8]]
    order = [1, 0, 2]  # single-token entries first
    ids = [t for i in order for t in prompts[i]]
    meta = metadata(ex, [tables[i] for i in order], [0, 0, 0],
                                    [len(prompts[i]) for i in order], block_size,
                                    cfg.num_queries_per_kv, torch.device("cpu"), attention_kernel)
    logits = ex.model(torch.tensor(ids), meta.positions, cache.layers, meta,
                      torch.arange(len(ids)))
    got = dict(zip(order, torch.split(logits, [len(prompts[i]) for i in order]), strict=True))
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-4)

    # Continue sequence 0 as a chunk of 5 tokens after its 37 cached ones, next to a decode of 2.
    extra = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    with torch.no_grad():
        full0 = ref(torch.tensor([prompts[0] + extra])).logits[0, -5:]
        full2 = ref(torch.tensor([prompts[2] + extra[:1]])).logits[0, -1:]
    meta = metadata(ex, [tables[2], tables[0]], [20, 37], [1, 5], block_size,
                                    cfg.num_queries_per_kv, torch.device("cpu"), attention_kernel)
    logits = ex.model(torch.tensor(extra[:1] + extra), meta.positions, cache.layers, meta,
                      torch.arange(6))
    torch.testing.assert_close(logits[0:1], full2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1:], full0, rtol=1e-4, atol=1e-4)


def test_missing_files_and_unknown_architecture(tmp_path) -> None:
    with pytest.raises(ValueError, match="not found"):
        ModelExecutor(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        ModelExecutor(str(tmp_path), device="cpu")

    save_tiny_causal_lm("llama", str(tmp_path))
    weights = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    os.rename(tmp_path / weights[0], tmp_path / "moved.bin")
    with pytest.raises(ValueError, match="safetensors"):
        ModelExecutor(str(tmp_path), device="cpu")
    os.rename(tmp_path / "moved.bin", tmp_path / weights[0])

    os.rename(tmp_path / "tokenizer.json", tmp_path / "tok.moved")
    os.rename(tmp_path / "tokenizer_config.json", tmp_path / "tokcfg.moved")
    with pytest.raises(ValueError, match="tokenizer.json"):
        ModelExecutor(str(tmp_path), device="cpu")
    os.rename(tmp_path / "tok.moved", tmp_path / "tokenizer.json")
    os.rename(tmp_path / "tokcfg.moved", tmp_path / "tokenizer_config.json")

    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "gpt2"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        ModelExecutor(str(tmp_path), device="cpu")


def test_bad_dtype_and_device() -> None:
    with pytest.raises(ValueError, match="dtype"):
        ModelExecutor("unused", dtype="int3", device="cpu")
    with pytest.raises(ValueError, match="device"):
        ModelExecutor("unused", device="tpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto"):
        ModelExecutor("unused", device="cpu", kv_cache_dtype="int8")


def test_many_decodes_of_different_lengths(tmp_path) -> None:
    """More decodes than one attention group holds, with contexts of many lengths."""
    ref = save_tiny_causal_lm("qwen3", str(tmp_path))
    ex = ModelExecutor(str(tmp_path), dtype="float32", device="cpu")
    cfg = ex.model_config
    block_size, n = 4, 37
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (int(length),), generator=gen).tolist()
               for length in torch.randint(3, 30, (n,), generator=gen)]
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, 400, 0,
                    torch.float32, torch.device("cpu"))
    perm = torch.randperm(400, generator=gen).tolist()  # scattered blocks
    tables = [perm[i * 10:(i + 1) * 10] for i in range(n)]
    # Prefill all but each prompt's last token, then decode the last tokens together.
    meta = metadata(ex, tables, [0] * n, [len(p) - 1 for p in prompts], block_size,
                                    cfg.num_queries_per_kv, torch.device("cpu"))
    ids = [t for p in prompts for t in p[:-1]]
    ex.model(torch.tensor(ids), meta.positions, cache.layers, meta, torch.tensor([0]))
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    meta = metadata(ex, [tables[i] for i in order], [len(prompts[i]) - 1 for i in order],
                                    [1] * n, block_size, cfg.num_queries_per_kv, torch.device("cpu"))
    assert len(meta.groups) > 1
    logits = ex.model(torch.tensor([prompts[i][-1] for i in order]), meta.positions, cache.layers,
                      meta, torch.arange(n))
    with torch.no_grad():
        for row, i in enumerate(order):
            expected = ref(torch.tensor([prompts[i]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_with_prepacked_weights_is_close(tmp_path) -> None:
    ref = save_tiny_causal_lm("qwen2", str(tmp_path))  # QKV bias: the packed path with a bias
    ex = ModelExecutor(str(tmp_path), dtype="bfloat16", device="cpu")
    cfg = ex.model_config
    assert cfg.dtype == "bfloat16"
    method = select_kernels(torch.device("cpu"), torch.bfloat16, cfg.head_dim).linear
    assert type(ex.model.layers[0].qkv_proj.method) is method
    assert type(ex.model.lm_head.method) is method
    prompt = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 4, 0, torch.bfloat16,
                    torch.device("cpu"))
    meta = metadata(ex, [[0, 1]], [0], [30], 16, cfg.num_queries_per_kv,
                                    torch.device("cpu"))
    got = ex.model(torch.tensor(prompt), meta.positions, cache.layers, meta, torch.arange(30))
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
