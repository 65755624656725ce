"""Which part of each checkpoint tensor a tensor-parallel rank loads (``layers/parallel.py``).

Names are transformers'; shapes are [out, in] as transformers stores them. The loaders ask
``weight_slice`` before reading a tensor, so a rank reads (and for GGUF dequantizes) only its
slice: a rank's peak memory is about 1/N of the weights, not all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.model.layers.parallel import ShardPlan


@dataclass(frozen=True)
class WeightSlice:
    axis: int  # 0: output rows, 1: input columns
    start: int
    stop: int


ZERO_UNLESS_FIRST = "zero"  # a row-parallel bias: rank 0 adds it, the others hold zeros

_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")


def weight_slice(name: str, plan: ShardPlan | None, head_dim: int) -> WeightSlice | str | None:
    """The slice of tensor ``name`` that ``plan``'s rank holds; None for the whole tensor
    (replicated, or no plan); ``ZERO_UNLESS_FIRST`` for a row-parallel bias."""
    if plan is None or plan.size == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return WeightSlice(0, plan.vocab_start, plan.vocab_end)
    m = _LAYER.fullmatch(name)
    if m is None:
        return None  # norms, rope frequencies
    proj, kind = m.group(2), m.group(3)
    q_start = plan.rank * plan.num_heads * head_dim
    q = (q_start, q_start + plan.num_heads * head_dim)
    kv_start = plan.kv_head_start * head_dim
    kv = (kv_start, kv_start + plan.num_kv_heads * head_dim)
    i_start = plan.rank * plan.intermediate
    inter = (i_start, i_start + plan.intermediate)
    columns = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}
    if proj in columns:
        return WeightSlice(0, *columns[proj])
    if proj in ("o", "down"):
        if kind == "bias":
            return ZERO_UNLESS_FIRST if plan.rank else None
        return WeightSlice(1, *(q if proj == "o" else inter))
    raise ValueError(f"unknown projection in weight {name!r}")
