"""Decode steps replayed from CUDA graphs, as nano-vllm does.

A graph is captured per batch size of a ladder (1, 2, 4, 8, then every 16 up to the largest
batch); a decode step of ``n`` sequences is padded to the smallest ladder size ``>= n`` and
replays that graph. Every graph reads the same static input buffers (token ids, positions,
cache slots, block tables, context lengths) and writes its own logits; a padded row has
slot -1 (no KV write) and context length 0 (the decode kernel gives it zeros). With several
KV-cache groups (a hybrid cache) each further group has static slots and block tables of its own.
Prefill steps, and decode batches beyond the ladder, run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.model.backends.sdpa import slots_and_positions, table_tensor

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
    block_tables: torch.Tensor  # [B, width] int32 (NULL_BLOCK entries: 0)
    seq_lens: torch.Tensor  # [B] int32, 0 in padded rows
    # KV-cache groups 1..G-1 (a hybrid cache): [G - 1, B] slots, [G - 1, B, width] tables
    group_slot_mapping: torch.Tensor | None = None
    group_block_tables: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The forward's arguments (the groups' only with several groups)."""
        first = (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                 self.seq_lens)
        if self.group_slot_mapping is None:
            return first
        return (*first, self.group_slot_mapping, self.group_block_tables)


def _slots_and_tables(block_tables: list[list[int]], positions: list[int], block_size: int,
                      batch_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's [B] slots (-1 in padded rows) and [B, width] tables (padding: 0)."""
    n = len(positions)
    slot_mapping, _ = slots_and_positions(block_tables, positions, [1] * n, block_size)
    tables = torch.zeros((batch_size, width), dtype=torch.int32)
    rows = table_tensor(block_tables, torch.int32)
    tables[:n, :rows.shape[1]] = rows
    return torch.tensor(slot_mapping + [-1] * (batch_size - n), dtype=torch.int64), tables


def prepare_decode_inputs(input_ids: list[int], positions: list[int],
                          block_tables: list[list[int]], block_size: int, batch_size: int,
                          width: int, group_tables: list[list[list[int]]] | None = None
                          ) -> DecodeInputs:
    """One token per sequence at ``positions``, padded to ``batch_size`` rows; ``group_tables``:
    KV-cache groups 1..G-1's tables (a hybrid cache)."""
    n = len(input_ids)
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit a graph of batch {batch_size}")
    if any(len(t) > width for t in block_tables):
        raise ValueError(f"a block table is longer than the graphs' {width} blocks")
    pad = batch_size - n
    slot_mapping, tables = _slots_and_tables(block_tables, positions, block_size, batch_size,
                                             width)
    inputs = DecodeInputs(
        torch.tensor(input_ids + [0] * pad, dtype=torch.int64),
        torch.tensor(positions + [0] * pad, dtype=torch.int64),
        slot_mapping,
        tables,
        torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32),
    )
    if group_tables:
        groups = [_slots_and_tables(t, positions, block_size, batch_size, width)
                  for t in group_tables]
        inputs.group_slot_mapping = torch.stack([slots for slots, _ in groups])
        inputs.group_block_tables = torch.stack([tables for _, tables in groups])
    return inputs


# forward(input_ids, positions, slot_mapping, block_tables, seq_lens[, group_slot_mapping,
# group_block_tables]) -> logits [B, vocab]
DecodeForward = Callable[..., torch.Tensor]


class CudaGraphRunner:
    """Captures ``forward`` once per ladder size (lazily, on the first step of that size) over
    static buffers of the largest size, and replays it."""

    def __init__(self, forward: DecodeForward, max_num_seqs: int, width: int,
                 device: torch.device, num_groups: int = 1) -> None:
        """``num_groups``: KV-cache groups, each with its own slots and block tables."""
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
        if num_groups > 1:
            self.inputs.group_slot_mapping = torch.full((num_groups - 1, top), -1,
                                                        dtype=torch.int64, device=device)
            self.inputs.group_block_tables = torch.zeros((num_groups - 1, top, width),
                                                         dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None  # one memory pool shared by every graph, as they never run at once

    def serves(self, num_seqs: int, max_blocks: int) -> bool:
        return padded_batch_size(num_seqs, self.sizes) is not None and max_blocks <= self.width

    def _views(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """The static inputs' first ``batch_size`` rows (of every group)."""
        return tuple(t[:batch_size] if i < 5 else t[:, :batch_size]
                     for i, t in enumerate(self.inputs.tensors()))

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
            block_size: int, group_tables: list[list[list[int]]] | None = None
            ) -> torch.Tensor:
        """Logits [B, vocab] of a decode step padded to its ladder size (its first rows are the
        real ones); ``group_tables``: KV-cache groups 1..G-1's tables."""
        batch_size = padded_batch_size(len(input_ids), self.sizes)
        inputs = prepare_decode_inputs(input_ids, positions, block_tables, block_size,
                                       batch_size, self.width, group_tables)
        for static, new in zip(self._views(batch_size), inputs.tensors(), strict=True):
            static.copy_(new, non_blocking=True)
        if batch_size not in self.graphs:
            self._capture(batch_size)
        self.graphs[batch_size].replay()
        return self.logits[batch_size]
