"""ModelConfig: a model's shape and what running it needs (Llama family, Gemma 3), read from an
HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.model.shape import ModelShape

# model_type (HF config.json) / general.architecture (GGUF) -> what the model needs to know.
SUPPORTED_ARCHITECTURES = {
    "llama": {"attention_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
    "gemma3": {"attention_bias": False, "qk_norm": True},
}
# An HF model_type that names an architecture above by another name.
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
# Gemma 3: every sixth layer attends globally, the others through the sliding window (the
# default of transformers' Gemma3TextConfig and llama.cpp), with these rope bases.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


def check_architecture(architecture: str, source: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r} in {source}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")


@dataclass
class ModelConfig(ModelShape):
    """The shape fields (``ModelShape``, keyword-only) and these."""

    name: str
    architecture: str  # a key of SUPPORTED_ARCHITECTURES
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

    def layer_window(self, layer: int) -> int | None:
        """The sliding window that layer ``layer`` attends through, None for its whole context."""
        return self.attention_windows[layer] or None

    @property
    def attention_scale(self) -> float | None:
        """The attention's scale where it is not head_dim**-0.5 (None: that default)."""
        if self.query_pre_attn_scalar is None or self.query_pre_attn_scalar == self.head_dim:
            return None
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """Build from a parsed config.json (transformers 4.x and 5.x spellings)."""
        arch = HF_MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type", ""))
        check_architecture(arch, f"{name}/config.json (model_type)")
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "vocab_size"):
            if key not in cfg:
                raise ValueError(f"{name}/config.json is missing {key!r}")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                              else None)
        eos = cfg.get("eos_token_id")
        config = cls(
            name=name,
            architecture=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            eos_token_ids=_as_list(eos),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(SUPPORTED_ARCHITECTURES[arch]["attention_bias"]
                                if cfg.get("attention_bias") is None else cfg["attention_bias"]),
            qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
            bos_token_id=cfg.get("bos_token_id"),
        )
        if arch == "gemma3":
            _gemma3_from_hf(config, cfg, name)
        return config


def _gemma3_from_hf(config: ModelConfig, cfg: dict[str, Any], name: str) -> None:
    """Gemma 3's own fields from its config.json: transformers 4.x's rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern, or 5.x's rope_parameters per
    layer kind and layer_types."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{name}/config.json: attn_logit_softcapping is not supported")
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get(FULL) or {}, rope.get(SLIDING) or {}
    config.rope_theta = float(full.get("rope_theta") or cfg.get("rope_theta")
                              or GEMMA3_GLOBAL_ROPE_THETA)
    config.rope_local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq")
                                    or GEMMA3_LOCAL_ROPE_THETA)
    scaling = cfg.get("rope_scaling") or full
    config.rope_scaling = (scaling if scaling.get("rope_type", scaling.get("type", "default"))
                           != "default" else None)
    layer_types = cfg.get("layer_types")
    config.sliding_window_pattern = (
        window_pattern(layer_types, config.num_layers, f"{name}/config.json") if layer_types
        else cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
    config.sliding_window = cfg.get("sliding_window") or 4096
    config.query_pre_attn_scalar = cfg.get("query_pre_attn_scalar") or 256
    config.final_logit_softcapping = cfg.get("final_logit_softcapping")
    config.hidden_activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    config.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))


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


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]
