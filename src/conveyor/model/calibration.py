"""Which input channels of each projection the int8 GEMM keeps exact (``Int8Panels.exact``).

QKV and gate/up read the normed hidden state, whose largest values sit in a few channels, the
same ones whatever the text: a property of the weights, as LLM.int8 and SmoothQuant found in
larger models (in SmolLM2-135M, channels such as 247 and 507 reach 10-30x a typical channel).
Rounded to 8 bits with the other 31 values of its block of 32, such a channel sets the block's
scale and leaves the others a few steps each. Calibration runs one prefill of a fixed text
through the model as loaded and takes, per projection, the channels whose |activation| was
largest. Rankings from this text, from random token ids and from chat prompts shared 10-14 of
their top 16 channels (docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.model.layers.linear import Linear

EXACT_CHANNELS = 16  # per projection: each adds a column of bf16 work to the int8 GEMM's tiles

CALIBRATION_TEXT = (
    "The history of the city begins in the Middle Ages, when merchants settled along the river. "
    "Over the centuries it grew into a center of trade, science and art.\n"
    "Question: What is 17 multiplied by 3? Answer: 17 x 3 = 51.\n"
    "def mean(values):\n    return sum(values) / len(values)\n"
    "Dear team, the meeting moves to Thursday at 10:30. Please bring the quarterly report, "
    "and let me know if you have any questions!\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; without it, "
    "most life on Earth could not exist."
)


def calibration_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(CALIBRATION_TEXT))


@torch.inference_mode()
def input_absmax(model: Any, linears: list[Linear], token_ids: list[int],
                 block_size: int = 16) -> dict[Linear, torch.Tensor]:
    """Per linear of ``model`` (a ``LlamaForCausalLM``), the largest |input| per channel over a
    prefill of ``token_ids`` (through a cache of its own, freed after)."""
    cfg, dtype = model.config, model.dtype
    device = model.norm.weight.device
    num_blocks = -(-len(token_ids) // block_size)
    caches = [tuple(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device) for _ in range(2))
              for _ in range(cfg.num_layers)]
    meta = model.backend.build_metadata([list(range(num_blocks))], [0], [len(token_ids)],
                                        block_size, cfg.num_heads // cfg.num_kv_heads, dtype)
    absmax: dict[Linear, torch.Tensor] = {}

    def record(linear: Linear, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        seen = inputs[0].abs().amax(0).float()
        absmax[linear] = torch.maximum(absmax[linear], seen) if linear in absmax else seen

    hooks = [linear.register_forward_hook(record) for linear in linears]
    try:
        ids = torch.tensor(token_ids, device=device)
        model(ids, meta.positions, caches, meta, torch.tensor([len(token_ids) - 1], device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return absmax


def exact_channels(model: Any, tokenizer: Any,
                   count: int = EXACT_CHANNELS) -> dict[Linear, torch.Tensor]:
    """For each layer's QKV and gate/up projections: the ``count`` channels (int32, ascending)
    to keep exact, from a prefill of ``CALIBRATION_TEXT``."""
    linears = [p for layer in model.layers for p in (layer.qkv_proj, layer.gate_up_proj)]
    absmax = input_absmax(model, linears, calibration_ids(tokenizer))
    return {linear: a.topk(count).indices.sort().values.to(torch.int32)
            for linear, a in absmax.items()}
