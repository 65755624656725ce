"""Random LoRA adapters in PEFT's format for a model's shapes: what ``bench throughput --lora N``
serves (N adapters of ``--lora-rank`` on every projection). Their values only need to be
finite: the workload ignores EOS, so every request generates its tokens whatever they are."""

from __future__ import annotations

import json
import os

import torch

from conveyor.lora.adapter import MODULES, module_shapes
from conveyor.model.config import ModelConfig


def write_random_adapters(cfg: ModelConfig, count: int, rank: int, root: str,
                          seed: int = 0) -> list[str]:
    """``count`` adapter directories under ``root``; their paths."""
    from safetensors.torch import save_file

    shapes = module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for k in range(count):
        path = os.path.join(root, f"adapter{k}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_layers):
            for module in MODULES:
                out, inp = shapes[module]
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{name}.lora_A.weight"] = 0.02 * torch.randn(rank, inp, generator=gen)
                tensors[f"{name}.lora_B.weight"] = 0.02 * torch.randn(out, rank, generator=gen)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(MODULES), "bias": "none"}, f)
        paths.append(path)
    return paths
