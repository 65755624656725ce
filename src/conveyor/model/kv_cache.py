"""The paged KV cache and its CPU swap pool.

One tensor ``[layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim]`` holds the K
and V of every slot of every block, so a block copy or swap is one indexed copy across all slots.
A block holds ``layers_per_group`` layers (``core.kv_cache_spec``): with KV-cache groups, layer
``l`` keeps its K/V in slot ``s`` of its group's blocks, ``(g, s) = layer_slots(...)[l]``; with
one group, layer ``l`` is slot ``l``. ``layers[l]`` is layer ``l``'s ``(k, v)`` views
``[num_blocks, block_size, kv_heads, head_dim]`` (its slot's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, num_cpu_blocks: int, dtype: torch.dtype, device: torch.device,
                 layer_slots: Sequence[int] | None = None):
        """``num_layers``: slots per block (``layers_per_group``); ``layer_slots``: each model
        layer's slot (None: layer i in slot i)."""
        if block_size < 1 or num_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"invalid cache shape: block_size={block_size}, "
                             f"num_gpu_blocks={num_blocks}, num_cpu_blocks={num_cpu_blocks}")
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.device = torch.device(device)
        self.cache = torch.zeros(shape, dtype=dtype, device=device)
        cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        # Only blocks written by swap_out are ever read, so the pool needs no zeroing: left
        # untouched, its pages cost no resident memory until swapping uses them.
        self.cpu_pool = torch.empty(cpu_shape, dtype=dtype, device="cpu",
                                    pin_memory=self.device.type == "cuda")
        slots = range(num_layers) if layer_slots is None else layer_slots
        self.layers = [(self.cache[s, 0], self.cache[s, 1]) for s in slots]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: device -> CPU pool."""
        if pairs and self.device.type == "cuda":
            self._copy_runs(pairs, self.cache, self.cpu_pool)
        elif pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs])
            self.cpu_pool[:, :, dst] = self.cache[:, :, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs: CPU pool -> device."""
        if pairs and self.device.type == "cuda":
            self._copy_runs(pairs, self.cpu_pool, self.cache)
        elif pairs:
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            self.cache[:, :, dst] = self.cpu_pool[:, :, src].to(self.device)

    @staticmethod
    def _copy_runs(pairs: list[tuple[int, int]], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Between the GPU cache and the pinned pool: per slot and K/V, one asynchronous copy per
        run of consecutive blocks (each a contiguous slab on both sides). The copies queue on the
        current stream, so the next step's kernels, and a later swap-in of these blocks, are
        ordered after them without a host sync."""
        runs = contiguous_runs(pairs)
        for layer in range(src.shape[0]):
            for kv in range(2):
                for s, d, n in runs:
                    dst[layer, kv, d:d + n].copy_(src[layer, kv, s:s + n], non_blocking=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src block, dst block) pairs within the device cache (copy-on-write)."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            self.cache[:, :, dst] = self.cache[:, :, src]


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as (src start, dst start, length) runs where both sides advance
    together: a swap of consecutive blocks becomes one copy per layer, not one per block."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs
