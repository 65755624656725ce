"""Random LoRA adapters in PEFT's format for a model's shapes: what ``bench throughput --lora N``
serves (N adapters of ``--lora-rank`` on every projection). Their values only need to be
finite: the workload ignores EOS, so every request generates its tokens whatever they are."""

from __future__ import annotations

import json
import os

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.registry import architecture


def write_random_adapters(cfg: ModelConfig, count: int, rank: int, root: str,
                          seed: int = 0) -> list[str]:
    """``count`` adapter directories under ``root``; their paths."""
    from safetensors.torch import save_file

    targets = architecture(cfg.architecture).lora_targets(cfg)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for k in range(count):
        path = os.path.join(root, f"adapter{k}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_layers):
            for target in targets.values():
                out, inp = target.shape
                name = f"base_model.model.model.layers.{layer}.{target.path}"
                tensors[f"{name}.lora_A.weight"] = 0.02 * torch.randn(rank, inp, generator=gen)
                tensors[f"{name}.lora_B.weight"] = 0.02 * torch.randn(out, rank, generator=gen)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(targets), "bias": "none"}, f)
        paths.append(path)
    return paths
