"""Tiny random models built in a test (nothing is downloaded): a word-level tokenizer and
sentence-transformers directories around a transformers decoder."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 96


def save_word_tokenizer(path: str, vocab_size: int = VOCAB, pad_token: str | None = None) -> None:
    """A tokenizer whose words are ``w3`` ... ``w{vocab_size - 1}`` (plus <unk>, <s>, </s>);
    ``pad_token``: one of those, for batches padded to one length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token=pad_token)
    fast.save_pretrained(path)


def randomize(model: torch.nn.Module) -> None:
    """Random weights everywhere (norms near 1), seeded."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))


def gemma3_model(common: dict, layer_types: list[str], sliding_window: int = 8):
    """A transformers Gemma 3 (text) of ``common``'s sizes with layers of ``layer_types``
    (``sliding_attention`` / ``full_attention``), head size 16, an attention scale of its own,
    linear rope scaling on the global layers and capped logits (weights not yet random)."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        **common, head_dim=16, sliding_window=sliding_window, query_pre_attn_scalar=24,
        layer_types=layer_types, final_logit_softcapping=3.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    return transformers.Gemma3ForCausalLM(cfg)


def save_hybrid_gemma3(path: str, sliding_window: int = 8):
    """A tiny random Gemma 3 saved at ``path`` (with ``save_word_tokenizer``'s tokenizer), six
    layers with every third global: KV-cache groups of two layers, the global (2, 5) and the
    sliding (0, 1) and (3, 4). Returns transformers' model."""
    model = gemma3_model(dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
                         (["sliding_attention"] * 2 + ["full_attention"]) * 2, sliding_window)
    randomize(model)
    model.eval()
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


def save_sentence_transformer(path: str, pooling: str, normalize: bool,
                              matryoshka_dimensions: list[int] | None = None,
                              vocab_size: int = VOCAB) -> None:
    """A sentence-transformers directory around a tiny random Qwen3 base model (saved as
    sentence-transformers saves one: base weight names, no LM head); ``pooling``: the Pooling
    module's mode (``lasttoken``, ``mean_tokens``, ``cls_token``)."""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3Model(cfg)
    randomize(model)
    model.eval()
    model.save_pretrained(path)
    save_word_tokenizer(path, vocab_size, pad_token="<unk>")
    if matryoshka_dimensions is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["matryoshka_dimensions"] = matryoshka_dimensions
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 256, "do_lower_case": False}, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64,
                   **{f"pooling_mode_{m}": m == pooling for m in modes},
                   "include_prompt": True}, f)


def save_tiny_llama(path: str):
    """A tiny random Llama causal LM (2 layers, 4 heads over 2 KV heads) and its tokenizer;
    returns the transformers model."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    randomize(model)
    model.eval()
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model


LORA_ADAPTERS = {  # name -> peft LoraConfig arguments
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all16": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                           "o_proj", "gate_proj", "up_proj",
                                                           "down_proj"]},
    "mlp8rs": {"r": 8, "lora_alpha": 16, "use_rslora": True,
               "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "ko4": {"r": 4, "lora_alpha": 32, "target_modules": ["k_proj", "o_proj"]},
}


def save_lora_models(root: str) -> dict[str, str]:
    """A tiny random Llama (``base``), a peft adapter per ``LORA_ADAPTERS`` entry with random A
    and B (peft starts B at zero), and each adapter merged into a copy of the base
    (``<name>_merged``, with the tokenizer): their directories under ``root``."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {"base": os.path.join(root, "base")}
    save_tiny_llama(paths["base"])
    for k, (name, config) in enumerate(LORA_ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(**config))
        torch.manual_seed(10 + k)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:
                    p.copy_(0.2 * torch.randn_like(p))
        paths[name] = os.path.join(root, name)
        peft_model.save_pretrained(paths[name])
        merged = os.path.join(root, name + "_merged")
        peft_model.merge_and_unload().save_pretrained(merged)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(paths["base"], f), merged)
        paths[name + "_merged"] = merged
    return paths
