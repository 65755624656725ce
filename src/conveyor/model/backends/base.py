"""What every backend provides (``Backend``) and what every step's metadata holds
(``StepMetadata``): one object per step, built by the backend from the step's entries and
read by every layer's attention."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepMetadata:
    """A step's metadata over one block table per entry. With several KV-cache groups (a hybrid
    cache: ``core.kv_cache_spec``) the backend builds one per group, from that group's tables,
    and the first (group 0's) lists every layer's in ``layer_metadata``."""

    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V goes
    positions: torch.Tensor  # [T] position of each new token in its sequence
    # per model layer: the metadata of its KV-cache group (None: this one serves every layer)
    layer_metadata: list[StepMetadata] | None = field(default=None, kw_only=True, repr=False)

    def per_layer(self, num_layers: int) -> list[StepMetadata]:
        """Each of ``num_layers`` layers' metadata."""
        return self.layer_metadata or [self] * num_layers

    @property
    def decode_only(self) -> bool:
        """Every token is a decode that ``CpuBackend``'s fused decode layers may serve."""
        return False


class Backend:
    """Everything the model runner and a model's layers call on a backend. A step's entries come
    ordered decodes (one token) first, then prefill chunks; ``proposals_as_decodes``: a decode
    carrying draft tokens is laid out as one-token entries (each attending to its own prefix)
    rather than as a chunk; ``captures_decode``: ``decode_metadata`` builds a decode step's
    metadata from tensors already on the device, so that a CUDA graph can capture it (the
    runner replays decode steps from graphs only then)."""

    name: str
    proposals_as_decodes: bool = True
    captures_decode: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def build_metadata(self, block_tables: list[list[int]], starts: list[int],
                       counts: list[int], block_size: int, num_queries_per_kv: int,
                       dtype: torch.dtype) -> StepMetadata:
        raise NotImplementedError

    def decode_metadata(self, slot_mapping: torch.Tensor, positions: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor) -> StepMetadata:
        """A decode step's metadata over tensors already on the device (a CUDA graph's static
        inputs), where ``captures_decode``."""
        raise NotImplementedError(f"the {self.name} backend builds no decode metadata from "
                                  "device tensors (captures_decode is False)")

    def plan_decode(self, max_context: int, num_kv_heads: int,
                    decode_batch_sizes: list[int]) -> None:
        """Told once by the runner: contexts up to ``max_context`` tokens over ``num_kv_heads``
        KV heads, decode steps padded to ``decode_batch_sizes`` (its CUDA graphs' ladder, which
        eager steps plan by too). Only a backend whose decode attention is planned per batch
        size (``TritonBackend``) keeps it."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with ``residual``: residual += x (in place), then norm(residual), in
        float32 and cast back, as transformers' LlamaRMSNorm. ``out``: a buffer the result may
        be written into (x itself, when the caller no longer needs it)."""
        raise NotImplementedError

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused [T, gate | up] row."""
        raise NotImplementedError

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` of a fused [T, gate | up] row (Gemma)."""
        raise NotImplementedError

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (HF "rotate_half" layout) by cos, sin [T, 1, head_dim];
        written into ``out`` when given and the backend can (x itself, to rotate in place)."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                  out: torch.Tensor | None = None, window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """Write this step's K/V ([T, kv_heads, head_dim]) into the cache ([num_blocks,
        block_size, kv_heads, head_dim]), then attend: q [T, heads, head_dim] (rows may be
        strided, heads packed) -> [T, heads * head_dim], written into ``out`` when it is a
        contiguous tensor of that shape and q's dtype.

        ``window`` (a sliding-window layer's): a token at position p attends to positions
        (p - window, p] only, and no block of the step's block tables that lies wholly before
        that range is read: a hybrid KV cache may have freed it, its entry naming a reused or
        null block. None: the whole context. ``scale``: of q.k (None: head_dim**-0.5)."""
        raise NotImplementedError


def output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``out`` when it is a contiguous tensor of ``shape`` and ``like``'s dtype, else a new one."""
    if out is None or tuple(out.shape) != shape or out.dtype != like.dtype or not out.is_contiguous():
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return out
