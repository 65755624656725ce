"""Read an HF model directory: config.json and the *.safetensors weights."""

from __future__ import annotations

import glob
import json
import os

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.layers.parallel import ShardPlan
from conveyor.model.shard_weights import ZERO_UNLESS_FIRST, weight_slice


def read_hf_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model directory {path} is missing config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    config = ModelConfig.from_hf_dict(cfg, name=os.path.basename(os.path.normpath(path)))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def read_hf_weights(path: str, plan: ShardPlan | None = None,
                    head_dim: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor, or with a tensor-parallel ``plan`` this rank's slice of each (read through
    ``get_slice``: the rest of a tensor is never read).

    A base-model checkpoint (names without ``model.``, as sentence-transformers saves an
    embedding model) is read under the causal LM's names, its missing head being the
    embedding."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path} has no *.safetensors weight files")
    weights = {}
    base = None
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            if base is None:
                base = not any(k.startswith(("model.", "lm_head.")) for k in keys)
            for key in keys:
                name = "model." + key if base else key
                sl = weight_slice(name, plan, head_dim)
                if sl is None:
                    weights[name] = f.get_tensor(key)
                elif sl == ZERO_UNLESS_FIRST:
                    weights[name] = torch.zeros(f.get_slice(key).get_shape())
                elif sl.axis == 0:
                    weights[name] = f.get_slice(key)[sl.start:sl.stop]
                else:
                    weights[name] = f.get_slice(key)[:, sl.start:sl.stop]
    if base and "model.embed_tokens.weight" in weights:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return weights
