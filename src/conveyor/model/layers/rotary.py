"""Rotary position embedding (HF "rotate_half" layout): the frequencies of every scaling a
checkpoint may declare, and cos/sin computed from positions on the fly; the rotation itself is
the model's backend's (``Backend.rotary``).

Scalings (``rope_scaling`` / ``rope_parameters`` of an HF config, ``rope.scaling.*`` of a GGUF
file: ``gguf_rope_scaling``), computed as ``transformers.modeling_rope_utils`` computes them, op
for op, so the inverse frequencies and the attention factor are its bits:

* ``linear``: the frequencies divided by ``factor``;
* ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between;
* ``yarn``: interpolated and extrapolated frequencies blended over the dimensions between the
  ``beta_fast`` and ``beta_slow`` rotations of the original context; cos and sin scaled by the
  attention factor (``0.1 ln(factor) + 1`` unless given);
* ``dynamic`` (NTK): a base grown for a longer context. transformers recomputes it at every
  forward from the batch's longest sequence, which would make a token's bits depend on its
  batch; here, as in vLLM, it is fixed at the longest context the scaling allows
  (``factor`` x ``max_position_embeddings``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic")


def _kind(scaling: dict[str, Any] | None) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: "
                         f"{', '.join(SUPPORTED)})")
    return kind


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  freq_factors: torch.Tensor | None = None,
                  max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32 for ``scaling`` (None: default).
    ``freq_factors``: a GGUF file's rope_freqs tensor (llama3 scaling baked in).
    ``max_position_embeddings``: the model's context (``dynamic``, and ``yarn`` without a
    ``factor``)."""
    if freq_factors is not None:
        return _base_inv_freq(head_dim, theta) / freq_factors.float()
    kind = _kind(scaling)
    if kind == "default":
        return _base_inv_freq(head_dim, theta)
    assert scaling is not None
    if kind == "linear":
        inv_freq = _base_inv_freq(head_dim, theta)
        inv_freq /= scaling["factor"]
        return inv_freq
    if kind == "llama3":
        return _llama3(_base_inv_freq(head_dim, theta), scaling)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    return _dynamic_inv_freq(head_dim, theta, scaling, max_position_embeddings)


def rope_attention_factor(scaling: dict[str, Any] | None,
                          max_position_embeddings: int | None = None) -> float:
    """What cos and sin are multiplied by: 1, but under ``yarn`` its attention factor."""
    if _kind(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    given = scaling.get("attention_factor")
    if given is not None:
        return given
    factor = _yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_mid, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict[str, Any], max_position_embeddings: int | None) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3's spelling: the ratio of the two contexts
        if max_position_embeddings is None:
            raise ValueError("yarn rope scaling without a factor needs max_position_embeddings")
        factor = max_position_embeddings / scaling["original_max_position_embeddings"]
    return factor


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                   max_position_embeddings: int | None) -> torch.Tensor:
    factor = _yarn_factor(scaling, max_position_embeddings)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    return (interpolation * (1 - extrapolation_factor)
            + extrapolation * extrapolation_factor)


def _dynamic_inv_freq(dim: int, base: float, scaling: dict[str, Any],
                      max_position_embeddings: int | None) -> torch.Tensor:
    if max_position_embeddings is None:
        raise ValueError("dynamic rope scaling needs max_position_embeddings")
    factor = scaling["factor"]
    seq_len = factor * max_position_embeddings  # the longest context it scales to
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(dim, base)


def gguf_rope_scaling(field: Callable[[str, Any], Any]) -> dict[str, Any] | None:
    """The scaling a GGUF file's ``{arch}.rope.scaling.*`` keys declare, in the HF spelling
    (None: none). ``field(key, default)`` reads ``{arch}.{key}``. llama.cpp's ``yarn`` keys:
    ``original_context_length``, ``attn_factor`` (where the converter wrote one),
    ``yarn_beta_fast`` / ``yarn_beta_slow``; llama 3's scaling is the rope_freqs tensor."""
    kind = field("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(field("rope.scaling.factor", 1.0))}
    original = field("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key, name in (("rope.scaling.attn_factor", "attention_factor"),
                      ("rope.scaling.yarn_beta_fast", "beta_fast"),
                      ("rope.scaling.yarn_beta_slow", "beta_slow")):
        value = field(key, None)
        if value is not None and kind == "yarn":
            scaling[name] = float(value)
    _kind(scaling)
    return scaling


class RotaryEmbedding:
    """Holds float32 inverse frequencies (kept out of nn.Module so a dtype cast never touches
    them) and the attention factor cos and sin are scaled by."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> None:
        self.inv_freq = inv_freq.float()
        self.attention_factor = attention_factor

    @staticmethod
    def of(head_dim: int, theta: float, scaling: dict[str, Any] | None,
           freq_factors: torch.Tensor | None = None,
           max_position_embeddings: int | None = None) -> RotaryEmbedding:
        """The rotary of a model's config (``rope_inv_freq``, ``rope_attention_factor``)."""
        return RotaryEmbedding(
            rope_inv_freq(head_dim, theta, scaling, freq_factors, max_position_embeddings),
            rope_attention_factor(scaling, max_position_embeddings))

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for broadcasting over heads (float32 math, like HF)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
