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
from conveyor.model.weights import (
    CheckpointTensor,
    CheckpointWeight,
    hf_tensor,
    rank_holds,
    rank_slice,
)


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


def read_hf_tensors(path: str, plan: ShardPlan | None = None, head_dim: int = 0,
                    architecture: str = "llama") -> Iterator[CheckpointTensor]:
    """Every tensor in the architecture's table of ``model/weights.py``, one at a time, or with
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
                    weight = hf_tensor(alias, architecture)
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
