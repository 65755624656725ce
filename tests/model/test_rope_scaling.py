"""Rotary scalings (YaRN, Llama 3's, linear, dynamic NTK): inverse frequencies and attention
factor bit-equal to transformers' (``modeling_rope_utils``), a GGUF file's ``rope.scaling.*``
keys read in the HF spelling, and tiny random Llama and Qwen3 models with a 32-token original
context generating greedy tokens past it as transformers does."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.model.layers.rotary import (
    RotaryEmbedding,
    gguf_rope_scaling,
    rope_attention_factor,
    rope_inv_freq,
)
from tiny_models import VOCAB, randomize, save_word_tokenizer

ORIGINAL = 32  # the tiny models' original context

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_betas_untruncated": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                               "beta_slow": 2.0, "truncate": False,
                               "original_max_position_embeddings": 4096},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                    "original_max_position_embeddings": 4096},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25,
                              "original_max_position_embeddings": 2048},
    "yarn_no_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_are_transformers_bits(name, theta, head_dim) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(SCALINGS[name])
    max_positions = 16384
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                      head_dim=head_dim, max_position_embeddings=max_positions,
                                      rope_parameters={**scaling, "rope_theta": theta})
    kind = scaling["rope_type"]
    # dynamic: transformers' frequencies at the longest context the scaling allows
    seq_len = scaling["factor"] * max_positions if kind == "dynamic" else None
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), seq_len=seq_len)
    got = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings=max_positions)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert rope_attention_factor(scaling, max_positions) == want_factor
    assert not torch.equal(got, rope_inv_freq(head_dim, theta, None))  # it does scale


def test_the_attention_factor_scales_cos_and_sin() -> None:
    scaling = SCALINGS["yarn"]
    plain = RotaryEmbedding(rope_inv_freq(64, 1e6, scaling, max_position_embeddings=131072))
    yarn = RotaryEmbedding.of(64, 1e6, scaling, max_position_embeddings=131072)
    positions = torch.arange(40000, 40005)
    factor = rope_attention_factor(scaling)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    for a, b in zip(yarn.cos_sin(positions, torch.float32), plain.cos_sin(positions, torch.float32),
                    strict=True):
        assert torch.equal(a, b * factor)


def test_gguf_keys_read_in_the_hf_spelling() -> None:
    fields = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
              "rope.scaling.original_context_length": 32768,
              "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    scaling = gguf_rope_scaling(lambda key, default: fields.get(key, default))
    assert scaling == {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                       "beta_slow": 1.0}
    linear = {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
    assert gguf_rope_scaling(lambda key, default: linear.get(key, default)) == {
        "rope_type": "linear", "factor": 2.0}
    assert gguf_rope_scaling(lambda key, default: {"rope.scaling.type": "none"}.get(key, default)) \
        is None
    assert gguf_rope_scaling(lambda key, default: default) is None
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        gguf_rope_scaling(lambda key, default: {"rope.scaling.type": "longrope"}.get(key, default))


def _save(kind: str, path: str, scaling: dict):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2,
                  rope_parameters={**scaling, "rope_theta": 10000.0})
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, tie_word_embeddings=False))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=False))
    randomize(model)
    model.eval()
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


@pytest.mark.parametrize(("kind", "scaling"), [
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    ("qwen3", {"rope_type": "linear", "factor": 4.0}),
], ids=["llama-yarn", "qwen3-yarn", "llama-llama3", "qwen3-linear"])
def test_greedy_tokens_past_the_original_context_equal_transformers(kind, scaling,
                                                                    tmp_path) -> None:
    ref = _save(kind, str(tmp_path), scaling)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (20, 9)]
    new = 100 - ORIGINAL  # up to position 120: well past the original 32
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", weight_compute="float", num_gpu_blocks=64,
              block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
