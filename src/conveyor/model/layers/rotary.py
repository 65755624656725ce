"""Rotary position embedding (HF "rotate_half" layout): the frequencies, and cos/sin computed
from positions on the fly; the rotation itself is the model's backend's (``Backend.rotary``)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32: default, ``linear`` or ``llama3`` scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # GGUF rope_freqs tensor (llama3 scaling baked in)
        return inv_freq / freq_factors.float()
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding:
    """Holds float32 inverse frequencies (kept out of nn.Module so a dtype cast never touches them)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.float()

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for broadcasting over heads (float32 math, like HF)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)
