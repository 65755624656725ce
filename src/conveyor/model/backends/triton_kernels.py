"""``TritonBackend``: the Triton kernels of ``model/kernels/triton/``, the CUDA path's backend
(it runs anywhere Triton does: its interpreter runs it on CPU tensors in the tests).

Attention: one call per layer writes the step's K/V into the cache and attends, decodes through
the split-K decode kernel, prefill chunks through the prefill kernel (a sliding-window layer's
``window`` given to both: they read no block before it). ``TritonMetadata``
carries what the kernels read: every entry's block table row and context length, where each
chunk's query rows start, and the decode kernel's number of context splits. The norm over
[T, D] rows, rotary and the activation are Triton kernels too; q/k norms over heads run
``TorchBackend``'s math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.model.backends.base import StepMetadata, output_buffer
from conveyor.model.backends.sdpa import (
    TorchBackend,
    num_leading_decodes,
    slots_and_positions,
    table_tensor,
)

DEFAULT_NUM_SMS = 132  # an H100's; used where the device cannot be asked (no GPU)


@dataclass
class TritonMetadata(StepMetadata):
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32, decodes first (padding: 0)
    seq_lens: torch.Tensor | None = None  # [S] int32: context length, this step's tokens included
    prefill_query_start: torch.Tensor | None = None  # [P + 1] int32: chunk p's rows after decodes
    num_decodes: int = 0
    max_query_len: int = 0  # longest prefill chunk (0 without chunks)
    num_splits: int = 1  # context splits of the decode kernel


class TritonBackend(TorchBackend):
    name = "triton"
    proposals_as_decodes = False  # the prefill kernel attends a proposal as one causal chunk
    captures_decode = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else DEFAULT_NUM_SMS)
        # the decode kernel's split plan (``plan_decode``, by the runner)
        self.max_context, self.num_kv_heads = 0, 1
        self.decode_batch_sizes: list[int] = []

    def plan_decode(self, max_context: int, num_kv_heads: int,
                    decode_batch_sizes: list[int]) -> None:
        self.max_context, self.num_kv_heads = max_context, num_kv_heads
        self.decode_batch_sizes = decode_batch_sizes

    def decode_splits(self, num_seqs: int) -> int:
        """The decode kernel's split count for a batch of ``num_seqs``: set for the longest
        context the model takes, as a graph replays with any; eager decode steps use the count
        of the ladder size they would pad to, so that both compute alike."""
        from conveyor.model.kernels.triton.decode_attention import num_splits_for

        padded = next((b for b in self.decode_batch_sizes if b >= num_seqs), num_seqs)
        return num_splits_for(self.max_context, padded, self.num_kv_heads, self.num_sms)

    def build_metadata(self, block_tables: list[list[int]], starts: list[int],
                       counts: list[int], block_size: int, num_queries_per_kv: int,
                       dtype: torch.dtype) -> TritonMetadata:
        num_decodes = num_leading_decodes(counts)
        if any(n == 1 for n in counts[num_decodes:]) or any(n < 1 for n in counts):
            raise ValueError("entries must be ordered with single-token entries first")
        slots, positions = slots_and_positions(block_tables, starts, counts, block_size)
        query_start = [0]
        for count in counts[num_decodes:]:
            query_start.append(query_start[-1] + count)

        def on_device(values: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return TritonMetadata(
            on_device(slots, torch.int64), on_device(positions, torch.int64),
            table_tensor(block_tables, torch.int32).to(self.device, non_blocking=True),
            on_device([s + n for s, n in zip(starts, counts, strict=True)]),
            on_device(query_start), num_decodes, max(counts[num_decodes:], default=0),
            self.decode_splits(max(num_decodes, 1)))

    def decode_metadata(self, slot_mapping: torch.Tensor, positions: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor) -> TritonMetadata:
        n = slot_mapping.shape[0]
        no_prefill = torch.zeros(1, dtype=torch.int32, device=self.device)
        return TritonMetadata(slot_mapping, positions, block_tables, seq_lens, no_prefill, n, 0,
                              self.decode_splits(n))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:
            return super().rms_norm(x, weight, eps, residual, out)
        from conveyor.model.kernels.triton.rms_norm import rms_norm

        return rms_norm(x, weight, eps, residual, out)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from conveyor.model.kernels.triton.elementwise import silu_mul

        return silu_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        from conveyor.model.kernels.triton.elementwise import rotary

        return rotary(x, cos, sin, out)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata,
                  out: torch.Tensor | None = None, window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        from conveyor.model.kernels.triton.decode_attention import decode_attention
        from conveyor.model.kernels.triton.kv_write import write_kv
        from conveyor.model.kernels.triton.prefill_attention import prefill_attention

        num_tokens, num_heads, head_dim = q.shape
        out = output_buffer(out, (num_tokens, num_heads * head_dim), q)
        heads_out = out.view(num_tokens, num_heads, head_dim)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        scale = head_dim ** -0.5 if scale is None else scale
        nd = meta.num_decodes
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                             meta.seq_lens[:nd], scale, meta.num_splits, out=heads_out[:nd],
                             window=window)
        if nd < meta.seq_lens.shape[0]:
            prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                              meta.seq_lens[nd:], meta.prefill_query_start, meta.max_query_len,
                              scale, out=heads_out[nd:], window=window)
        return out
