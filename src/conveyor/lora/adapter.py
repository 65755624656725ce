"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into the
A and B matrices of each projection, checked against the base model's shapes.

PEFT names a weight ``base_model.model.model.layers.N.<path>.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]), ``<path>`` a projection's in transformers' model
(``self_attn.q_proj``: the architecture's LoRA targets, ``model/registry.py``); the update is ``B @ A * scale`` with
``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA. Anything PEFT can write
that this engine would compute differently (biases, DoRA, extra trained modules, per-module
ranks, layers of another shape) is refused with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.registry import architecture

_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scale: float
    # (layer, module) -> (A [r, in], B [out, r])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection LoRA may target, in the base model's full shapes, by PEFT
    module name in the architecture's table order (the tensor-parallel wire's module numbers)."""
    return {name: t.shape for name, t in
            architecture(cfg.architecture).lora_targets(cfg).items()}


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path``; ValueError naming what is wrong."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is missing (expected a PEFT "
                         "adapter directory)")
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {name!r}: {config_path} is not JSON ({e})") from e
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json needs an integer r >= 1 "
                         f"and a number lora_alpha, got r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank="
                         f"{max_rank}; raise --max-lora-rank")
    unsupported = {"bias": config.get("bias", "none") != "none"}
    for key in ("use_dora", "modules_to_save", "fan_in_fan_out", "rank_pattern",
                "alpha_pattern"):
        unsupported[key] = bool(config.get(key))
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} is missing")
    from safetensors.torch import load_file

    tensors = load_file(weights_path)
    targets = {t.path: t for t in architecture(cfg.architecture).lora_targets(cfg).values()}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _NAME.fullmatch(key)
        if m is None or m.group(2) not in targets or int(m.group(1)) >= cfg.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} names no projection of "
                             f"this model's {cfg.num_layers} layers")
        parts.setdefault((int(m.group(1)), targets[m.group(2)].name), {})[m.group(3)] = tensor
    shapes = module_shapes(cfg)
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    adapter = LoRAAdapter(name, rank, scale)
    for (layer, module), ab in sorted(parts.items()):
        out, inp = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
            got = {k: tuple(v.shape) for k, v in ab.items()}
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} needs lora_A "
                             f"{(rank, inp)} and lora_B {(out, rank)}, got {got}")
        adapter.weights[(layer, module)] = (a.float(), b.float())
    return adapter
