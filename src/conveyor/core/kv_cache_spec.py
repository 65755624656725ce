"""KV-cache specs and groups: which layers share a block table, and what a block holds.

A model's attention layers come in kinds (*specs*): full attention (a query attends to every
earlier position) and sliding-window attention (a query at position p attends to positions
``p - W + 1 .. p`` only). Layers of one spec are cut, in layer order, into *KV-cache groups* of
the same size, ``layers_per_group`` = the greatest common divisor of the per-spec layer counts
(the largest size that divides every count, so no group is padded). Gemma 3 270M: 3 global and
15 window layers -> 6 groups of 3 layers, 1 full-attention group and 5 sliding-window groups.

All groups share one pool of uniform blocks (vLLM v1's hybrid layout): a block holds
``layers_per_group`` layers' K/V for ``block_size`` tokens, and each request has one block
table per group. Layer ``groups[g].layers[s]`` keeps its K/V in slot ``s`` of the blocks of
table ``g`` (``layer_slots``). Full-attention groups come first, so group 0 is full attention
whenever the model has a full-attention layer (the block manager's prefix cache is keyed on
group 0's identity chain, see ``block_manager``).

The default layout (``CacheConfig.kv_cache_groups == ()``) is one full-attention group of every
layer: ``layers_per_group`` is then the model's layer count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Layers that attend to every earlier position: a request keeps all its blocks."""

    @property
    def sliding_window(self) -> int:
        """0: no window."""
        return 0


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Layers whose query at position p attends to positions ``p - sliding_window + 1 .. p``:
    blocks wholly before that are never read again and go back to the pool."""

    sliding_window: int

    def __post_init__(self) -> None:
        w = self.sliding_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"SlidingWindowSpec.sliding_window must be an integer >= 1, got {w!r}")


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers of one spec that share a block table; ``layers[s]`` uses slot ``s`` of a block."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


def spec_for_window(window: int) -> KVCacheSpec:
    """The spec of a layer with sliding window ``window`` (0: full attention)."""
    return SlidingWindowSpec(window) if window else FullAttentionSpec()


def kv_cache_groups(layer_windows: Sequence[int]) -> tuple[KVCacheGroup, ...]:
    """Groups for a model whose layer ``i`` has sliding window ``layer_windows[i]`` (0: full
    attention): each spec's layers in layer order, cut into groups of ``layers_per_group`` (the
    gcd of the per-spec counts); full-attention groups first, then by window, then by layer."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ValueError(f"layer {layer}: sliding window must be an integer >= 0 "
                             f"(0: full attention), got {window!r}")
        by_window.setdefault(window, []).append(layer)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    groups = []
    for window in sorted(by_window):
        layers = by_window[window]
        spec = spec_for_window(window)
        groups.extend(KVCacheGroup(spec, tuple(layers[i:i + size]))
                      for i in range(0, len(layers), size))
    return tuple(groups)


def layers_per_group(groups: Sequence[KVCacheGroup], num_layers: int) -> int:
    """Layers whose K/V one block holds (``num_layers`` for the default single group)."""
    return len(groups[0].layers) if groups else num_layers


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """Per model layer: (group, slot within the group's blocks)."""
    if not groups:
        return [(0, layer) for layer in range(num_layers)]
    slots = [(-1, -1)] * num_layers
    for g, group in enumerate(groups):
        for s, layer in enumerate(group.layers):
            slots[layer] = (g, s)
    return slots


def check_groups(groups: Sequence[KVCacheGroup], owner: str) -> None:
    """ValueError (naming ``owner``) unless ``groups`` is a valid layout: equal group sizes, each
    layer 0..N-1 in exactly one group, full-attention groups first."""
    if not groups:
        return
    size = len(groups[0].layers)
    seen: list[int] = []
    for g, group in enumerate(groups):
        if not isinstance(group, KVCacheGroup):
            raise ValueError(f"{owner}.kv_cache_groups[{g}] must be a KVCacheGroup, got {group!r}")
        if not isinstance(group.spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(f"{owner}.kv_cache_groups[{g}].spec must be a FullAttentionSpec or "
                             f"SlidingWindowSpec, got {group.spec!r}")
        if len(group.layers) != size or size == 0:
            raise ValueError(f"{owner}.kv_cache_groups: every group must have the same number "
                             f"(>= 1) of layers; group 0 has {size}, group {g} has "
                             f"{len(group.layers)}")
        if g and group.spec.sliding_window == 0 and groups[g - 1].spec.sliding_window:
            raise ValueError(f"{owner}.kv_cache_groups: full-attention groups come first "
                             f"(group {g} follows a sliding-window group)")
        seen.extend(group.layers)
    if sorted(seen) != list(range(len(seen))):
        raise ValueError(f"{owner}.kv_cache_groups must hold each layer 0..{len(seen) - 1} "
                         f"exactly once, got {sorted(seen)}")
