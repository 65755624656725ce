"""ModelConfig: a model's shape and what running it needs, as the loaders read it from an HF
config.json (``hf_loader``) or GGUF metadata (``gguf_loader``) through the architecture's
declaration (``model/registry.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.model.shape import ModelShape

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass
class ModelConfig(ModelShape):
    """The shape fields (``ModelShape``, keyword-only) and these."""

    name: str
    architecture: str  # a registered architecture (model/registry.py)
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"  # the dtype the weights run in, set by the loader
    num_params: int = 0  # of the loaded network, set by the loader
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    # Gemma 3 (None / defaults elsewhere; its window and layout are ModelShape's
    # sliding_window and sliding_window_pattern): the rope base of the sliding layers
    # (``rope_theta`` and ``rope_scaling`` are the full layers'), the attention scale's
    # query_pre_attn_scalar**-0.5 (None: head_dim**-0.5), the final logits' tanh cap, the MLP's
    # gate activation.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # A mixture of experts (model/moe.py; 0 experts elsewhere): each sparse layer's experts, how
    # many each token uses, their intermediate size, whether the top-k weights are renormalized,
    # the layers that keep a dense MLP; OLMoE norms q and k over all heads at once.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_mlp_layers: list[int] = field(default_factory=list)
    qk_norm_whole: bool = False

    def sparse_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window that layer ``layer`` attends through, None for its whole context."""
        return self.attention_windows[layer] or None

    @property
    def attention_scale(self) -> float | None:
        """The attention's scale where it is not head_dim**-0.5 (None: that default)."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5


def window_pattern(layer_types: list[str], num_layers: int, source: str) -> int:
    """``layer_types`` (transformers' SLIDING / FULL per layer) as ``ModelShape``'s
    sliding_window_pattern: N when every N-th layer is global and the others sliding, 0 when
    every layer is sliding; another layout is refused."""
    if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(f"{source}: layer_types must give {num_layers} layers each "
                         f"{SLIDING!r} or {FULL!r}, got {layer_types!r}")
    if FULL not in layer_types:
        return 0
    for n in range(1, num_layers + 1):
        if layer_types == [FULL if (i + 1) % n == 0 else SLIDING for i in range(num_layers)]:
            return n
    raise ValueError(f"{source}: layer_types {layer_types!r} is not every N-th layer global, "
                     "the only layout supported")

