"""The token embedding: a [vocab, hidden] table (under tensor parallelism this rank's rows of the
vocabulary, ``layers/parallel.py``), looked up in its dense Parameter or, once a GGUF file's
8-bit blocks of it (or its bytes of another type, ``GGUFBlocks``) are loaded and no lm_head
multiplies by the dense table, in those (``rows``): a model whose lm_head holds a packed copy of
its own then keeps one table, not two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.layers.gguf_blocks import FileBlocks, GGUFBlocks
from conveyor.model.layers.parameters import load_rows, new_parameter
from conveyor.model.layers.quantized import Int8Blocks


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = new_parameter(num_embeddings, embedding_dim)
        # the checkpoint's blocks (one unnamed shard), shared with a tied lm_head (Linear.tie)
        self.blocks: dict[None, FileBlocks] = {}
        self.table: Int8Blocks | GGUFBlocks | None = None  # serves lookups in place of the weight
        self.dtype = torch.float32  # the rows' from the table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def load(self, param: str, shard: None, tensor: torch.Tensor,
             blocks: FileBlocks | None = None) -> None:
        """The checkpoint's table, and its blocks where the file stores it so."""
        load_rows(self.weight, 0, self.weight.shape[0], tensor)
        if blocks is not None:
            self.blocks[shard] = blocks

    def process_weights_after_loading(self, shared: bool) -> None:
        """Look rows up in the checkpoint's 8-bit blocks or ``GGUFBlocks``, the dense table
        dropped, unless it is ``shared`` with an lm_head that multiplies by it."""
        blocks, self.blocks = self.blocks.get(None), {}
        if isinstance(blocks, (Int8Blocks, GGUFBlocks)) and not shared:
            self.dtype = self.weight.dtype
            self.table, self.weight = blocks, None

    def nbytes(self) -> int:
        """Bytes of the table held outside the Parameter (its blocks)."""
        return 0 if self.table is None else self.table.nbytes()
