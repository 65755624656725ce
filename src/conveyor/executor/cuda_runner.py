"""The CUDA path's forward pass: the model over Triton paged attention, decode steps replayed
from CUDA graphs (``cuda_graphs.py``), everything else eager.

``ModelExecutor`` hands it a step's flat token ids and per-entry block tables, starts and counts
(decodes first, then prefill chunks) and gets back the logits of the sampling positions. It
runs on any device torch and Triton can drive; graphs are captured only on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.executor.cuda_graphs import (
    CudaGraphRunner,
    graph_batch_sizes,
    padded_batch_size,
    prepare_decode_inputs,
)
from conveyor.model.config import ModelConfig
from conveyor.model.kv_cache import KVCache
from conveyor.model.layers.attention import AttentionMetadata
from conveyor.model.layers.triton_attention import (
    TritonBatch,
    build_triton_batch,
    flatten_entries,
)

DEFAULT_NUM_SMS = 132  # an H100's; used where the device cannot be asked (no GPU)


class CudaModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv_cache: KVCache,
                 max_num_seqs: int, enforce_eager: bool, device: torch.device) -> None:
        self.model, self.config, self.kv_cache, self.device = model, config, kv_cache, device
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else DEFAULT_NUM_SMS)
        block_size = kv_cache.block_size
        width = -(-config.max_position_embeddings // block_size)
        self.no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max(max_num_seqs, 1), device=device)
        self.ladder = graph_batch_sizes(max_num_seqs)
        self.graphs = (CudaGraphRunner(self._decode_forward, max_num_seqs, width, device)
                       if device.type == "cuda" and not enforce_eager else None)

    def decode_splits(self, num_seqs: int) -> int:
        """The decode kernel's split count for a batch of ``num_seqs``: set for the longest
        context the model takes, as a graph replays with any; eager decode steps (with graphs
        off too) use the count of the graph they would pad to, so both compute alike."""
        from conveyor.model.kernels.triton.decode_attention import num_splits_for

        num_seqs = padded_batch_size(num_seqs, self.ladder) or num_seqs
        return num_splits_for(self.config.max_position_embeddings, num_seqs,
                              self.config.num_kv_heads, self.num_sms)

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        batch = TritonBatch(block_tables, seq_lens, self.no_prefill, n, 0, self.decode_splits(n))
        meta = AttentionMetadata(slot_mapping, positions, None, [], triton=batch)
        return self.model(input_ids, positions, self.kv_cache.layers, meta, self.rows[:n])

    def forward(self, input_ids: list[int], block_tables: list[list[int]], starts: list[int],
                counts: list[int], logits_indices: list[int],
                hidden_indices: list[int] | None = None) -> Any:
        flat = flatten_entries(block_tables, starts, counts, self.kv_cache.block_size)
        n = len(counts)
        width = max(len(t) for t in block_tables)
        lora = self.model.lora
        if (self.graphs is not None and hidden_indices is None and flat.num_decodes == n
                and (lora is None or not lora.active)
                and self.graphs.serves(n, width)):
            inputs = prepare_decode_inputs(input_ids, flat.positions, flat.slot_mapping,
                                           block_tables, padded_batch_size(n, self.graphs.sizes),
                                           self.graphs.width)
            logits = self.graphs.run(inputs)
            return logits[torch.tensor(logits_indices, device=self.device)]
        batch = build_triton_batch(flat, self.device, self.decode_splits(max(flat.num_decodes, 1)))
        meta = AttentionMetadata(torch.tensor(flat.slot_mapping, device=self.device),
                                 torch.tensor(flat.positions, device=self.device), None, [],
                                 triton=batch)
        hidden = (None if hidden_indices is None
                  else torch.tensor(hidden_indices, device=self.device))
        return self.model(torch.tensor(input_ids, device=self.device), meta.positions,
                          self.kv_cache.layers, meta,
                          torch.tensor(logits_indices, device=self.device), hidden)
