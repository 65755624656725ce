"""Read an HF model directory: config.json and the *.safetensors weights."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.layers.parallel import ShardPlan
from conveyor.model.registry import Architecture, hf_architecture
from conveyor.model.weights import CheckpointTensor, CheckpointWeight, rank_holds, rank_slice


def read_hf_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model directory {path} is missing config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    config = config_from_hf_dict(cfg, name=os.path.basename(os.path.normpath(path)))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def config_from_hf_dict(cfg: dict[str, Any], name: str) -> ModelConfig:
    """A parsed config.json (transformers 4.x and 5.x spellings) as a ``ModelConfig``: the
    shared fields here, the architecture's own through its declaration's ``hf_config``."""
    arch = hf_architecture(cfg.get("model_type", ""), f"{name}/config.json (model_type)")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{name}/config.json is missing {key!r}")
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                          else None)
    config = ModelConfig(
        name=name,
        architecture=arch.name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        eos_token_ids=_as_list(cfg.get("eos_token_id")),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(arch.attention_bias if cfg.get("attention_bias") is None
                            else cfg["attention_bias"]),
        qk_norm=arch.qk_norm,
        bos_token_id=cfg.get("bos_token_id"),
    )
    if arch.hf_config is not None:
        arch.hf_config(config, cfg, name)
    return config


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def read_hf_tensors(path: str, arch: Architecture, plan: ShardPlan | None = None,
                    head_dim: int = 0) -> Iterator[CheckpointTensor]:
    """Every tensor in the architecture's table (``model/registry.py``), one at a time, or with
    a tensor-parallel ``plan`` this rank's slice of each (read through ``get_slice``: the rest of
    a tensor is never read). A Gemma norm's weight w comes as the 1 + w the model holds.

    A base-model checkpoint (names without ``model.``, as sentence-transformers saves an
    embedding model) is read under the causal LM's names, its missing head being the
    embedding."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path} has no *.safetensors weight files")
    base = None
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            if base is None:
                base = not any(k.startswith(("model.", "lm_head.")) for k in keys)
            for key in keys:
                name = "model." + key if base else key
                if "rotary_emb" in name:  # older checkpoints' saved rope buffers
                    continue
                for alias in (name, "lm_head.weight") if base and name == EMBEDDING else (name,):
                    weight = arch.hf_tensor(alias)
                    if weight is None:
                        raise ValueError(f"unexpected weight {name!r} in the checkpoint")
                    if rank_holds(weight.spec, plan):
                        tensor = _read(f, key, weight, plan, head_dim)
                        if weight.spec.hf_plus_one:
                            tensor = tensor.float() + 1
                        yield CheckpointTensor(weight, tensor)


EMBEDDING = "model.embed_tokens.weight"


def _read(f: Any, key: str, weight: CheckpointWeight, plan: ShardPlan | None,
          head_dim: int) -> torch.Tensor:
    sl = rank_slice(weight.spec, plan, head_dim)
    if sl is None:
        return f.get_tensor(key)
    if sl.axis == 0:
        return f.get_slice(key)[sl.start:sl.stop]
    return f.get_slice(key)[:, sl.start:sl.stop]
