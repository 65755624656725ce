"""ModelShape: a Llama-family decoder's sizes, and the parameter and FLOP counts that follow.

One type for every reader of a model's shape: the model's ``ModelConfig`` (read from a
checkpoint), the bench's roofline and the simulator's ``ModelSpec`` (read from YAML) extend it.
Plain Python, no torch: the simulator imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

ShapeT = TypeVar("ShapeT", bound="ModelShape")


@dataclass(kw_only=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False  # the LM head is the input embedding
    # Sliding-window attention (Gemma 3's config keys): window layers attend to the last
    # ``sliding_window`` positions; with ``sliding_window_pattern`` N, every N-th layer
    # (i + 1 divisible by N) is global, the others window layers; 0: every layer a window layer.
    sliding_window: int = 0  # 0: every layer attends to the whole prefix
    sliding_window_pattern: int = 0

    @classmethod
    def from_dict(cls: type[ShapeT], values: dict[str, Any]) -> ShapeT:
        """Built from ``values`` (a report's model config), ignoring keys that are no field."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def shape_dict(self) -> dict[str, Any]:
        """The shape fields alone (of a subclass too), for reports."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape)}

    @property
    def attention_windows(self) -> list[int]:
        """Each layer's sliding window, 0 for full attention (``core.kv_cache_spec``'s input)."""
        w, pattern = self.sliding_window, self.sliding_window_pattern
        if not w:
            return [0] * self.num_layers
        return [0 if pattern and (i + 1) % pattern == 0 else w for i in range(self.num_layers)]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of one decoder layer's matmuls: q, k, v, o and the gated MLP."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        return attention + mlp

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def matmul_params(self) -> int:
        """Weights every forward reads in full: the layers' matmuls and the LM head (the input
        embedding is only gathered row by row)."""
        return self.num_layers * self.linear_params_per_layer + self.lm_head_params

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def linear_flops_per_token(self) -> int:
        return 2 * self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_flops(self) -> int:
        """Of one sampled position."""
        return 2 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV of one (query, key) pair, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim
