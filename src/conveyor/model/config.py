"""ModelConfig: a Llama-family model's shape and what running it needs, read from an HF
config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.model.shape import ModelShape

# model_type (HF config.json) / general.architecture (GGUF) -> what the Llama-family model needs to know.
SUPPORTED_ARCHITECTURES = {
    "llama": {"attention_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
}


def check_architecture(architecture: str, source: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r} in {source}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")


@dataclass
class ModelConfig(ModelShape):
    """The shape fields (``ModelShape``, keyword-only) and these."""

    name: str
    architecture: str  # "llama" | "qwen2" | "qwen3"
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"  # the dtype the weights run in, set by the loader
    num_params: int = 0  # of the loaded network, set by the loader
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """Build from a parsed config.json (transformers 4.x and 5.x spellings)."""
        arch = cfg.get("model_type", "")
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
        return cls(
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


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]
