"""The token embedding: a [vocab, hidden] table (under tensor parallelism this rank's rows of the
vocabulary, ``layers/parallel.py``), looked up in its dense Parameter or, where a GGUF file
stores it as blocks (``GGUFBlocks``, any type), in those (``rows``): the blocks are loaded as
they are, and no dense table is made unless a tied lm_head multiplies by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.layers.gguf_blocks import GGUFBlocks, int_blocks
from conveyor.model.layers.parameters import load_rows, new_parameter
from conveyor.model.layers.quantized import Int8Blocks


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # the dense table, made when the checkpoint brings it dense (load)
        self.weight: nn.Parameter | None = None
        # the checkpoint's blocks (one unnamed shard), read by a tied lm_head (Linear.tie)
        self.blocks: dict[None, GGUFBlocks] = {}
        self.table: Int8Blocks | GGUFBlocks | None = None  # serves lookups in place of the weight
        self.dtype = torch.float32  # the rows' from the table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(ids, self.dtype)
        if self.weight is None:
            raise RuntimeError("this embedding has no table: load one (VocabEmbedding.load)")
        return F.embedding(ids, self.weight)

    def load(self, param: str, shard: None, tensor: torch.Tensor | None,
             blocks: GGUFBlocks | None = None) -> None:
        """The checkpoint's table: its blocks where the file stores it so, else dense."""
        if blocks is not None:
            blocks.check_shape(self.num_embeddings, self.embedding_dim)
            self.blocks[shard] = blocks
            return
        if self.weight is None:
            self.weight = new_parameter(self.num_embeddings, self.embedding_dim)
        load_rows(self.weight, 0, self.num_embeddings, tensor)

    def process_weights_after_loading(self, dtype: torch.dtype,
                                      shared: nn.Parameter | None = None) -> None:
        """Look rows up in the checkpoint's blocks (in ``dtype``; Q8_0 ones as ``Int8Blocks``,
        fewer operations a lookup), or in ``shared``, the dense table a tied lm_head multiplies
        by (made from those blocks), where there is one."""
        blocks, self.blocks = self.blocks.get(None), {}
        if blocks is None:
            return
        if shared is not None:
            self.weight = shared
            return
        codes = int_blocks(blocks)
        self.dtype, self.table = dtype, codes if isinstance(codes, Int8Blocks) else blocks

    def nbytes(self) -> int:
        """Bytes of the table held outside the Parameter (its blocks)."""
        return 0 if self.table is None else self.table.nbytes()
