"""Every registered architecture (``model/registry.py``) loads a tiny random transformers model
from HF safetensors and from the GGUF file llama.cpp's converter would write of it (its experts'
tensors stacked, Mixtral as a Llama file with experts), through its declaration alone: every ``Linear`` of the module tree goes through its method's post-load step,
the GGUF model computes transformers' logits, and a Q8_0 file under integer compute keeps its
blocks and no dense copy of any weight."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.kv_cache import KVCache
from conveyor.model.layers.block_method import Int8BlockMethod
from conveyor.model.layers.linear import Linear
from conveyor.model.layers.quantized import Int8Blocks
from conveyor.model.loader import load_model
from conveyor.model.registry import architecture, architectures, hf_architecture
from tiny_models import VOCAB, save_tiny_causal_lm, write_gguf

# the tiny model each architecture is tested on (tiny_models.save_tiny_causal_lm's kinds; Llama's
# without llama 3's rope scaling, which GGUF carries as a rope_freqs tensor write_gguf omits)
TINY = {"llama": "llama_tied", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_gguf",
        "qwen3_moe": "qwen3_moe", "olmoe": "olmoe", "mixtral": "mixtral"}
CPU = torch.device("cpu")


def test_every_architecture_has_a_tiny_model() -> None:
    assert sorted(TINY) == architectures()
    assert hf_architecture("gemma3_text", "x") is architecture("gemma3")
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2' in x; supported"):
        architecture("gpt2", "x")


def linears(model: torch.nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    cfg = model.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 8, 0, torch.float32, CPU)
    meta = model.backend.build_metadata([list(range(8))], [0], [len(prompt)], 8,
                                        cfg.num_queries_per_kv, torch.float32)
    return model(torch.tensor(prompt), meta.positions, cache.layers, meta,
                 torch.arange(len(prompt)))


@pytest.mark.parametrize("arch", sorted(TINY))
def test_loads_from_hf_and_gguf_through_its_declaration(arch, tmp_path) -> None:
    ref = save_tiny_causal_lm(TINY[arch], str(tmp_path / "hf"))
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]

    hf = load_model(str(tmp_path / "hf"), torch.float32, CPU, "float", with_tokenizer=False)
    cfg = hf.config
    assert cfg.architecture == arch
    sparse = sum(cfg.sparse_layer(i) for i in range(cfg.num_layers))
    # per layer qkv, o and a dense MLP's two, or a router and each expert's two; the lm_head
    assert len(linears(hf.model)) == (2 * cfg.num_layers + 2 * (cfg.num_layers - sparse)
                                      + sparse * (1 + 2 * cfg.num_experts) + 1)
    assert all(p.processed for p in linears(hf.model))
    torch.testing.assert_close(prefill_logits(hf.model, prompt), expected, rtol=1e-4, atol=1e-4)

    f32 = str(tmp_path / f"{arch}-f32.gguf")
    write_gguf(ref, arch, f32)
    gguf = load_model(f32, torch.float32, CPU, "float", with_tokenizer=False)
    assert all(p.processed for p in linears(gguf.model))
    torch.testing.assert_close(prefill_logits(gguf.model, prompt), expected, rtol=1e-4,
                               atol=1e-4)

    q8 = str(tmp_path / f"{arch}-q8_0.gguf")
    write_gguf(ref, arch, q8, "Q8_0")
    quant = load_model(q8, torch.float32, CPU, "auto", with_tokenizer=False)
    if quant.weight_compute != "int8":
        pytest.skip("integer compute needs the C++ kernels")
    for p in linears(quant.model):
        assert p.processed and isinstance(p.method, Int8BlockMethod) and p.weight is None
    assert isinstance(quant.model.embed_tokens.table, Int8Blocks)  # Q8_0 codes, as the file's
    assert quant.model.embed_tokens.weight is None
    got = prefill_logits(quant.model, prompt)
    # 8-bit weights and activations: close to the float model's, not equal; further off with
    # experts, where a token whose top-k scores nearly tie may route differently
    bound = 0.3 if cfg.num_experts else 0.05
    assert (got - expected).norm() < bound * expected.norm()
