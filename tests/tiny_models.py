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


def gemma3_model(common: dict, layer_types: list[str], sliding_window: int = 8,
                 query_pre_attn_scalar: int = 24):
    """A transformers Gemma 3 (text) of ``common``'s sizes with layers of ``layer_types``
    (``sliding_attention`` / ``full_attention``), head size 16, an attention scale of its own
    (``query_pre_attn_scalar``; 16 gives GGUF's, which has no key for it), linear rope scaling
    on the global layers and capped logits (weights not yet random)."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        **common, head_dim=16, sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar,
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


def save_tiny_causal_lm(kind: str, path: str):
    """A tiny random causal LM of ``kind`` (``llama``: with Llama 3's rope scaling,
    ``llama_tied``, ``qwen2``, ``qwen3``: a head size of 24, ``gemma3``: a sliding and a global
    layer, ``gemma3_gguf``: the same with the attention scale a GGUF file implies; mixtures of
    experts: ``qwen3_moe`` (8 experts, top 4, normalized weights, its second layer dense),
    ``olmoe`` (8 experts, top 4), ``mixtral`` (8 experts, top 2)) saved at ``path`` with
    ``save_word_tokenizer``'s tokenizer; returns transformers' model."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "gemma3":
        model = gemma3_model(common, ["sliding_attention", "full_attention"])
    elif kind == "gemma3_gguf":
        model = gemma3_model(common, ["sliding_attention", "full_attention"],
                             query_pre_attn_scalar=16)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=8,
                                          num_experts_per_tok=4, moe_intermediate_size=32,
                                          norm_topk_prob=True, mlp_only_layers=[1],
                                          tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "olmoe":
        cfg = transformers.OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8,
                                       num_experts_per_tok=4, pad_token_id=0)
        model = transformers.OlmoeForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "intermediate_size": 32},
                                         num_local_experts=8, num_experts_per_tok=2,
                                         tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    randomize(model)  # random everything, biases and norms included
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


def write_gguf(model, architecture: str, path: str, quant: str = "F32") -> None:
    """transformers' causal LM ``model`` as llama.cpp's converter writes it, for Conveyor's
    ``architecture`` (``model/registry.py``: its GGUF name, its tensor names, its Q/K row
    permutation, Gemma's ``1 + w`` norms, each expert's tensors stacked into one): its metadata,
    its norms in F32 and its matrices in ``quant`` (``F32`` or ``Q8_0``, quantized by the gguf
    package). No tokenizer: load it ``with_tokenizer=False``."""
    import gguf
    import numpy as np

    from conveyor.model.registry import architecture as declaration

    arch, cfg = declaration(architecture), model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    name = arch.gguf_name or architecture  # general.architecture
    w = gguf.GGUFWriter(path, name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if architecture == "gemma3":
        full = rope.get("full_attention", {})
        w.add_rope_freq_base(full.get("rope_theta", 1e6))
        if full.get("rope_type", "default") != "default":
            w.add_string(f"{name}.rope.scaling.type", full["rope_type"])
            w.add_float32(f"{name}.rope.scaling.factor", full["factor"])
        w.add_uint32(f"{name}.attention.sliding_window", cfg.sliding_window)
        types = cfg.layer_types
        w.add_uint32(f"{name}.attention.sliding_window_pattern",
                     types.index("full_attention") + 1)
        if cfg.final_logit_softcapping:
            w.add_float32(f"{name}.final_logit_softcapping", cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if arch.gguf_experts:
        w.add_uint32(f"{name}.expert_count", experts)
        w.add_uint32(f"{name}.expert_used_count", cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_uint32(f"{name}.expert_feed_forward_length", cfg.moe_intermediate_size)
    tied = bool(cfg.tie_word_embeddings)
    tensors: dict[str, list] = {}  # GGUF name -> its arrays (every expert's, stacked below)
    for key, tensor in _saved_tensors(model).items():
        if tied and key == "lm_head.weight":
            continue
        found = arch.hf_tensor(key)
        if found is None:
            raise ValueError(f"{key} has no GGUF name in {architecture}'s table")
        spec = found.spec
        gguf_name = spec.gguf if found.layer is None else f"blk.{found.layer}.{spec.gguf}"
        arr = tensor.float().numpy().copy()
        if spec.hf_plus_one:
            arr = arr + 1
        if spec.rope_permuted and arch.gguf_rope_permuted:  # llama.cpp's permute
            n = arr.shape[0] // head_dim
            arr = (arr.reshape(n, 2, arr.shape[0] // n // 2, *arr.shape[1:])
                   .swapaxes(1, 2).reshape(arr.shape))
        tensors.setdefault(gguf_name, []).append((found.expert or 0, arr))
    for gguf_name, arrays in tensors.items():
        parts = [a for _, a in sorted(arrays, key=lambda p: p[0])]
        arr = np.ascontiguousarray(np.stack(parts) if len(parts) > 1 else parts[0],
                                   dtype=np.float32)
        if quant == "Q8_0" and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(arr, kind)
            w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _saved_tensors(model) -> dict:
    """The tensors ``save_pretrained`` writes (transformers 5's fused experts split per expert,
    as it saves them): read back from a save into a temporary folder."""
    import glob
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        out = {}
        for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            out.update(load_file(file))
    return out
