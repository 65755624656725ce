"""Rotary position embedding (HF "rotate_half" layout), computed from positions on the fly."""

from __future__ import annotations

import math
from typing import Any

import torch

from conveyor.model.kernels import fused_ops
from conveyor.model.kernels.triton.common import triton_available


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, heads, head_dim] -> the rotated tensor: one pass in ``kernels/fused_ops.cpp`` on the
    CPU, or in ``kernels/triton/elementwise.py`` on CUDA, which write it into ``out`` when given
    (x itself, to rotate in place); else a new one."""
    if x.is_cuda and triton_available():
        from conveyor.model.kernels.triton.elementwise import rotary

        return rotary(x, cos, sin, out)
    fused = fused_ops.rotary(x, cos, sin, out)
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
