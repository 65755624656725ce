"""Megatron-style tensor parallelism inside the model: which slice of each weight a rank holds,
and the collectives that stitch the slices back together.

* Column-parallel (QKV, gate/up): each rank computes its own heads / intermediate columns; no
  communication.
* Row-parallel (o_proj, down): each rank multiplies its slice of the input features and the
  partial sums are all-reduced (``RowParallelLinear``): one all-reduce each per layer.
  Under whole sums (``TensorParallel.whole_sums``, integer compute) they split their outputs
  instead (``WholeSumLinear``): the inputs' slices are all-gathered, each rank computes its
  slice of the hidden outputs over the whole input and the slices are all-gathered. Each output
  is then the one dot product a single process computes, in its order: the bits of one process
  (a sum of partial sums rounds otherwise, and the next layer's 8-bit activations can turn an
  ulp into a different code).
* Vocab-parallel embedding: a rank looks up only the ids in its vocabulary range, zeroes the
  rest, and the rows are all-reduced. The LM head computes the rank's vocabulary columns of the
  sampled rows only, gathered onto rank 0, which samples.
* KV heads are split like the query heads; when there are more ranks than KV heads each rank
  holds a copy of the one KV head its query heads read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.layers.linear import Linear


@dataclass
class CollectiveTimer:
    """Seconds spent in the layers' collectives by this rank since the last ``reset`` (for
    benchmarks): the row-parallel projections' all-reduces, or under whole sums the all-gathers
    that replace them (two a projection)."""
    all_reduce_s: float = 0.0
    num_all_reduces: int = 0

    def reset(self) -> None:
        self.all_reduce_s, self.num_all_reduces = 0.0, 0


@dataclass
class TensorParallel:
    """This process's place in the tensor-parallel group (torch.distributed's default group)."""
    rank: int
    size: int
    whole_sums: bool = False  # row-parallel projections as ``WholeSumLinear``
    timer: CollectiveTimer = field(default_factory=CollectiveTimer)

    @staticmethod
    def of(rank: int, size: int, weight_compute: str, deterministic: bool = True
           ) -> TensorParallel:
        """Rank ``rank`` of ``size`` for a model of ``weight_compute`` (resolved: ``int8`` or
        ``float``): whole sums, the bits of one process, under integer compute (so that every
        rank's activations round to 8 bits as one process's do) and wherever the model is
        ``deterministic``; partial sums only for float compute with ``deterministic=False``."""
        return TensorParallel(rank, size, whole_sums=weight_compute == "int8" or deterministic)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(x)
        self.timer.all_reduce_s += time.perf_counter() - start
        self.timer.num_all_reduces += 1
        return x

    def all_gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's [rows, width] columns side by side, in rank order: [rows, size * width]
        on every rank (each rank's ``local`` of one shape)."""
        import torch.distributed as dist

        start = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        self.timer.all_reduce_s += time.perf_counter() - start
        self.timer.num_all_reduces += 1
        return torch.cat(parts, dim=1)

    def gather_to_first(self, local: torch.Tensor, full_width: int) -> torch.Tensor | None:
        """Concatenate every rank's [rows, width_r] columns on rank 0 ([rows, full_width]);
        None on the other ranks. Shards are padded to one width for the collective."""
        import torch.distributed as dist

        width = -(-full_width // self.size)
        if local.shape[1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)[:, :full_width] if parts is not None else None


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds of a model: ranges along the sharded axes."""
    rank: int
    size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    kv_head_start: int
    intermediate: int  # intermediate columns per rank
    vocab_start: int
    vocab_end: int
    whole_sums: bool = False  # row-parallel projections split their outputs (WholeSumLinear)
    hidden: int = 0  # under whole sums: those projections' outputs (hidden features) per rank

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes one rank's layers are built with."""
        return replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate)


def check_tensor_parallel(cfg: ModelConfig, size: int, whole_sums: bool = False) -> None:
    """ValueError naming tensor_parallel_size when ``cfg`` cannot be split ``size`` ways
    (``whole_sums``: the hidden features are split too)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of "
                         f"the model's {cfg.num_kv_heads} KV heads")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                         f"intermediate size {cfg.intermediate_size}")
    if whole_sums and cfg.hidden_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's hidden size "
                         f"{cfg.hidden_size} (whole sums split the attention's and the MLP's "
                         "output projections by their outputs; --no-deterministic with "
                         "--weight-compute float takes partial sums instead)")
    if cfg.vocab_size < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the vocabulary size")


def shard_plan(cfg: ModelConfig, rank: int, size: int, whole_sums: bool = False) -> ShardPlan:
    """What rank ``rank`` of ``size`` holds; ``whole_sums``: ``TensorParallel.whole_sums``."""
    check_tensor_parallel(cfg, size, whole_sums)
    if cfg.num_kv_heads >= size:
        kv_heads, kv_start = cfg.num_kv_heads // size, rank * (cfg.num_kv_heads // size)
    else:
        kv_heads, kv_start = 1, rank // (size // cfg.num_kv_heads)
    vocab_per_rank = -(-cfg.vocab_size // size)
    return ShardPlan(rank, size, cfg.num_heads // size, kv_heads, kv_start,
                     cfg.intermediate_size // size, min(rank * vocab_per_rank, cfg.vocab_size),
                     min((rank + 1) * vocab_per_rank, cfg.vocab_size), whole_sums,
                     cfg.hidden_size // size if whole_sums else 0)


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features; the partial outputs are summed
    across ranks. A bias is held by rank 0 only (the others' are zero), so it is added once."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(super().forward(x))


class WholeSumLinear(Linear):
    """A row-parallel projection under whole sums: a Linear over the whole input and this rank's
    slice of the outputs (rows of the weight, and of a bias). Its input comes as this rank's
    slice of the features, like ``RowParallelLinear``'s, and its output is the whole row."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel,
                 bias: bool = False) -> None:
        """``in_features``, ``out_features``: the whole input's and this rank's outputs."""
        super().__init__(in_features, out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_columns(super().forward(self.tp.all_gather_columns(x)))


def row_parallel_linear(in_features: int, out_features: int,
                        tp: TensorParallel | None) -> Linear:
    """A row-parallel projection (o_proj, down) of a layer built with this rank's shapes:
    ``in_features`` this rank's input features, ``out_features`` the whole output's."""
    if tp is None:
        return Linear(in_features, out_features)
    if tp.whole_sums:
        return WholeSumLinear(in_features * tp.size, out_features // tp.size, tp)
    return RowParallelLinear(in_features, out_features, tp)


def vocab_parallel_rows(lookup, input_ids: torch.Tensor, plan: ShardPlan,
                        tp: TensorParallel) -> torch.Tensor:
    """Embedding rows of ``input_ids`` when each rank holds rows [vocab_start, vocab_end):
    ``lookup(local_ids)`` reads this rank's table; ids held elsewhere contribute zeros."""
    outside = (input_ids < plan.vocab_start) | (input_ids >= plan.vocab_end)
    local = (input_ids - plan.vocab_start).masked_fill_(outside, 0)
    rows = lookup(local)
    rows.masked_fill_(outside[:, None], 0)
    return tp.all_reduce_(rows)
