"""calibration.py on the shipped SmolLM2: the channels it keeps exact for QKV and gate/up are the
model's, not the calibration text's: another text's largest channels are mostly the same ones,
and keeping them exact shrinks the rounding error of that text's activations."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.calibration import EXACT_CHANNELS, exact_channels, input_absmax
from conveyor.model.loader import load_model

OTHER_TEXT = ("<|im_start|>user\nWrite a short poem about the sea, then explain in one "
              "sentence why the tides rise and fall.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, torch.bfloat16, torch.device("cpu"))


def rounding_error(x: torch.Tensor, keep: torch.Tensor | None) -> float:
    """Relative error of x rounded to 8 bits per block of 32, ``keep``'s channels left exact."""
    x = x.float()
    rounded = x.clone()
    if keep is not None:
        rounded[:, keep.long()] = 0
    blocks = rounded.view(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    rounded = (torch.round(blocks / step) * step).view_as(x)
    if keep is not None:
        rounded[:, keep.long()] = x[:, keep.long()]
    return float((rounded - x).norm() / x.norm())


def test_exact_channels_are_the_models(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    chosen = exact_channels(model, tokenizer)
    linears = [p for layer in model.layers for p in (layer.qkv_proj, layer.gate_up_proj)]
    assert list(chosen) == linears
    for channels in chosen.values():
        assert channels.dtype == torch.int32 and channels.numel() == EXACT_CHANNELS
        assert torch.equal(channels, channels.unique())  # distinct, ascending

    other = input_absmax(model, linears, tokenizer.encode(OTHER_TEXT))
    shared = [len(set(chosen[p].tolist()) & set(other[p].topk(EXACT_CHANNELS).indices.tolist()))
              for p in linears]
    assert sum(shared) / len(shared) >= EXACT_CHANNELS / 2  # measured: 10.9 of 16

    # The other text's own activations (captured the same way, whole rows this time).
    inputs: dict = {}
    hooks = [p.register_forward_hook(lambda m, a, out: inputs.__setitem__(m, a[0].clone()))
             for p in linears]
    try:
        input_absmax(model, [], tokenizer.encode(OTHER_TEXT))
    finally:
        for hook in hooks:
            hook.remove()
    plain = sum(rounding_error(inputs[p], None) for p in linears)
    kept = sum(rounding_error(inputs[p], chosen[p]) for p in linears)
    assert kept < plain / 1.5  # measured: 2.3x smaller
