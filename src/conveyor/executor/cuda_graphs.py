"""Decode steps replayed from CUDA graphs, as nano-vllm does.

A graph is captured per batch size of a ladder (1, 2, 4, 8, then every 16 up to the largest
batch); a decode step of ``n`` sequences is padded to the smallest ladder size ``>= n`` and
replays that graph. Every graph reads the same static input buffers (token ids, positions,
cache slots, block tables, context lengths) and writes its own logits; a padded row has
slot -1 (no KV write) and context length 0 (the decode kernel gives it zeros). Prefill steps,
and decode batches beyond the ladder, run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.model.backends.sdpa import slots_and_positions

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH) -> list[int]:
    top = max(1, min(max_num_seqs, limit))
    sizes = {b for b in (1, 2, 4, 8) if b <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(sizes)


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The ladder size a decode batch of ``num_seqs`` pads to; None when it is beyond the
    ladder (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """A decode step's inputs, padded to a ladder size, on the host."""
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64, -1 in padded rows
    block_tables: torch.Tensor  # [B, width] int32
    seq_lens: torch.Tensor  # [B] int32, 0 in padded rows


def prepare_decode_inputs(input_ids: list[int], positions: list[int],
                          block_tables: list[list[int]], block_size: int, batch_size: int,
                          width: int) -> DecodeInputs:
    """One token per sequence at ``positions``, padded to ``batch_size`` rows."""
    n = len(input_ids)
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit a graph of batch {batch_size}")
    if any(len(t) > width for t in block_tables):
        raise ValueError(f"a block table is longer than the graphs' {width} blocks")
    pad = batch_size - n
    slot_mapping, _ = slots_and_positions(block_tables, positions, [1] * n, block_size)
    tables = torch.zeros((batch_size, width), dtype=torch.int32)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return DecodeInputs(
        torch.tensor(input_ids + [0] * pad, dtype=torch.int64),
        torch.tensor(positions + [0] * pad, dtype=torch.int64),
        torch.tensor(slot_mapping + [-1] * pad, dtype=torch.int64),
        tables,
        torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32),
    )


# forward(input_ids, positions, slot_mapping, block_tables, seq_lens) -> logits [B, vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         torch.Tensor]


class CudaGraphRunner:
    """Captures ``forward`` once per ladder size (lazily, on the first step of that size) over
    static buffers of the largest size, and replays it."""

    def __init__(self, forward: DecodeForward, max_num_seqs: int, width: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.width = width
        top = self.sizes[-1]
        self.inputs = DecodeInputs(
            torch.zeros(top, dtype=torch.int64, device=device),
            torch.zeros(top, dtype=torch.int64, device=device),
            torch.full((top,), -1, dtype=torch.int64, device=device),
            torch.zeros((top, width), dtype=torch.int32, device=device),
            torch.zeros(top, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None  # one memory pool shared by every graph, as they never run at once

    def serves(self, num_seqs: int, max_blocks: int) -> bool:
        return padded_batch_size(num_seqs, self.sizes) is not None and max_blocks <= self.width

    def _views(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        s = self.inputs
        return (s.input_ids[:batch_size], s.positions[:batch_size], s.slot_mapping[:batch_size],
                s.block_tables[:batch_size], s.seq_lens[:batch_size])

    def _capture(self, batch_size: int) -> None:
        views = self._views(batch_size)
        self.forward(*views)  # warm up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[batch_size] = self.forward(*views)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[batch_size] = graph

    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]],
            block_size: int) -> torch.Tensor:
        """Logits [B, vocab] of a decode step padded to its ladder size (its first rows are the
        real ones)."""
        batch_size = padded_batch_size(len(input_ids), self.sizes)
        inputs = prepare_decode_inputs(input_ids, positions, block_tables, block_size,
                                       batch_size, self.width)
        s = self.inputs
        for static, new in zip((s.input_ids, s.positions, s.slot_mapping, s.block_tables,
                                s.seq_lens), (inputs.input_ids, inputs.positions,
                                              inputs.slot_mapping, inputs.block_tables,
                                              inputs.seq_lens), strict=True):
            static[:batch_size].copy_(new, non_blocking=True)
        if batch_size not in self.graphs:
            self._capture(batch_size)
        self.graphs[batch_size].replay()
        return self.logits[batch_size]
