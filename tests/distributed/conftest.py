"""Tiny random HF models for tensor-parallel tests: 8 query heads, so 2 and 4 ranks split them."""

from __future__ import annotations

import pytest
import torch

VOCAB = 96


def build_tiny(kind: str, path: str, num_kv_heads: int, max_positions: int = 256,
               vocab_size: int = VOCAB) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    common = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, tie_word_embeddings=False))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=True))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    build_tiny("llama", path, num_kv_heads=2)
    return path


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    build_tiny("qwen3", path, num_kv_heads=4)
    return path



@pytest.fixture(scope="module")
def tiny_llama_long(tmp_path_factory) -> str:
    """The tiny Llama with room for the benchmark workloads' prompts, outputs and token ids."""
    path = str(tmp_path_factory.mktemp("tiny_llama_long"))
    build_tiny("llama", path, num_kv_heads=2, max_positions=1024, vocab_size=512)
    return path
