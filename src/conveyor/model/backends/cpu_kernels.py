"""``CpuBackend``: the C++ kernels of ``model/kernels/`` (``torch.ops.conveyor.*``).

Attention: every token of a step goes to the kernel of ``kernels/paged_attention.cpp``, in any
entry order: each token attends to its own causal prefix, read straight from its sequence's
blocks. No padding, no mask, no gathered keys. Where the kernel does not take the model's
dtypes or head size (``attention_kernel_available``), attention is ``TorchBackend``'s.
The norm, rotary and activation kernels (SiLU, and Gemma's tanh GeLU) serve float32/bf16 rows
whose widths are multiples of 16 (a per-head norm's rows are its heads); a call they do not take
runs ``TorchBackend``'s math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.model.backends.base import StepMetadata
from conveyor.model.backends.sdpa import (
    TorchBackend,
    num_leading_decodes,
    slots_and_positions,
    table_tensor,
)
from conveyor.model.kernels import fused_ops
from conveyor.model.kernels.paged_attention import kernel_attention


@dataclass
class KernelMetadata(StepMetadata):
    """Token t attends to the first ``context_lens[t]`` positions of the sequence whose block
    table is row ``token_seqs[t]``."""
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32 (padding: 0)
    context_lens: torch.Tensor | None = None  # [T] int32, the token itself included
    token_seqs: torch.Tensor | None = None  # [T] int32; None in a decode-only step (t -> row t)

    @property
    def decode_only(self) -> bool:
        return self.token_seqs is None


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, device: torch.device, attention_kernel: bool) -> None:
        super().__init__(device)
        self.attention_kernel = attention_kernel

    def build_metadata(self, block_tables: list[list[int]], starts: list[int],
                       counts: list[int], block_size: int, num_queries_per_kv: int,
                       dtype: torch.dtype) -> StepMetadata:
        if not self.attention_kernel:
            return super().build_metadata(block_tables, starts, counts, block_size,
                                          num_queries_per_kv, dtype)
        slots, positions = slots_and_positions(block_tables, starts, counts, block_size)
        table = table_tensor(block_tables, torch.int32)
        context_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        token_seqs = None
        if num_leading_decodes(counts) < len(counts):
            token_seqs = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32),
                                                 torch.tensor(counts))
        return KernelMetadata(torch.tensor(slots), torch.tensor(positions), table, context_lens,
                              token_seqs)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 3 and residual is None:
            # Per-head norms (q/k norms of [T, heads, head_dim], whose rows may be strided views
            # of the QKV output): every head a row of the same kernel, as the one-call decode
            # layers norm them (a copy where the heads are not evenly spaced).
            fused = fused_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
            if fused is not None:
                return fused.view(x.shape)
        fused = fused_ops.rms_norm(x, weight, eps, residual, out) if x.dim() == 2 else None
        return fused if fused is not None else super().rms_norm(x, weight, eps, residual, out)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = fused_ops.silu_mul(gate_up)
        return fused if fused is not None else super().silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = fused_ops.gelu_tanh_mul(gate_up)
        return fused if fused is not None else super().gelu_tanh_and_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        fused = fused_ops.rotary(x, cos, sin, out)
        return fused if fused is not None else super().rotary(x, cos, sin, out)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                  out: torch.Tensor | None = None, window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        if not isinstance(meta, KernelMetadata):  # TorchBackend's metadata: its attention
            return super().attention(q, k, v, k_cache, v_cache, meta, out, window, scale)
        return kernel_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                q.shape[2] ** -0.5 if scale is None else scale, meta.token_seqs,
                                out=out, new_kv=(k, v, meta.slot_mapping), window=window)
