"""The model registry: one declaration per architecture, and the only place that tells
architectures apart by name.

A declaration (``Architecture``) names what every part of the engine needs to know of a model
family: the ``model_type`` values of its HF ``config.json`` and its GGUF
``general.architecture``; what its config adds to the shape both read (biases, q/k norms, a
hook for the fields only it has); its module class; its checkpoint-name table
(``model/weights.py``), from which its packed modules (q/k/v in ``qkv_proj``, gate/up in
``gate_up_proj``), its LoRA targets and its tensor-parallel splits follow; whether llama.cpp's
converter permuted its Q/K rows; and how the one-call decode kernel describes its layers. The
loaders (``hf_loader``, ``gguf_loader``, ``loader``), LoRA (``lora/adapter.py``, the model's
``set_lora_slot``), tensor-parallel slicing and the fused decode (``fused_decode.py``) read it.

Adding an architecture: a model file (its ``nn.Module``, usually a few overrides of
``llama.py``'s), a weight table if its checkpoint names differ, and one ``register`` call here
(docs/model.md walks through one).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.model.config import FULL, SLIDING, ModelConfig, window_pattern
from conveyor.model.weights import (
    GEMMA3_LAYER_WEIGHTS,
    GEMMA3_MODEL_WEIGHTS,
    LAYER_WEIGHTS,
    MIXTRAL_LAYER_WEIGHTS,
    MODEL_WEIGHTS,
    MOE_LAYER_WEIGHTS,
    CheckpointWeight,
    Split,
    WeightSpec,
)

if TYPE_CHECKING:
    from torch import nn

# A GGUF metadata reader: (key without the architecture's prefix, default) -> value.
GGUFField = Callable[[str, Any], Any]


@dataclass(frozen=True)
class DecodeLayerKind:
    """How ``kernels/decode_layer.cpp`` runs a layer of this architecture: the MLP's gate
    activation (``kernels/decode_layer.ACTIVATIONS``) and whether the layer norms its attention's
    and MLP's outputs (Gemma 3's ``post_attention_norm`` / ``post_feedforward_norm``)."""
    activation: str = "silu"
    output_norms: bool = False


@dataclass(frozen=True)
class LoRATarget:
    """A projection an adapter may update: its PEFT module name (``q_proj``), its transformers
    path inside a layer (``self_attn.q_proj``), the model's module that holds it (``qkv_proj``)
    and its full (out, in) shape."""
    name: str
    path: str
    module: str
    shape: tuple[int, int]


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture and the GGUF general.architecture
    hf_model_types: tuple[str, ...]  # config.json model_type values
    model_class: str  # "module:Class", imported when a model is built
    layer_weights: tuple[WeightSpec, ...] = LAYER_WEIGHTS
    model_weights: tuple[WeightSpec, ...] = MODEL_WEIGHTS
    attention_bias: bool = False  # the default where config.json does not say
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary
    # llama.cpp's converter interleaves each head's rope pairs in Q and K (Llama only)
    gguf_rope_permuted: bool = False
    # the fields only this architecture has, after the shared ones are read
    hf_config: Callable[[ModelConfig, dict[str, Any], str], None] | None = None
    gguf_config: Callable[[ModelConfig, GGUFField], None] | None = None
    decode_layer: DecodeLayerKind | None = DecodeLayerKind()  # None: no one-call decode
    # llama.cpp's general.architecture for it (None: ``name``), and whether its files there
    # have experts (Mixtral's are "llama" files with experts)
    gguf_name: str | None = None
    gguf_experts: bool = False

    def module_class(self) -> type[nn.Module]:
        module, cls = self.model_class.split(":")
        return getattr(importlib.import_module(module), cls)

    @property
    def packed_modules(self) -> dict[str, tuple[str, ...]]:
        """Each stacked module's parts in order (``qkv_proj``: q, k, v), from the table."""
        packed: dict[str, tuple[str, ...]] = {}
        for s in self.layer_weights:
            if s.shard is not None and s.param == "weight":
                packed[s.module] = (*packed.get(s.module, ()), s.shard)
        return packed

    def hf_tensor(self, name: str) -> CheckpointWeight | None:
        """The table's entry for a transformers tensor name, None when it has none."""
        return self._lookup(name, _HF_LAYER, "hf")

    def gguf_tensor(self, name: str) -> CheckpointWeight | None:
        """The table's entry for a GGUF tensor name, None when it has none."""
        return self._lookup(name, _GGUF_LAYER, "gguf")

    def checkpoint_weights(self, num_layers: int, num_experts: int = 0) -> list[CheckpointWeight]:
        """Every entry of the table for a model of ``num_layers`` layers (of ``num_experts``
        experts each, where it has experts)."""
        return ([CheckpointWeight(s) for s in self.model_weights]
                + [CheckpointWeight(s, i, e) for i in range(num_layers) for s in self.layer_weights
                   for e in (range(num_experts) if s.expert else [None])])

    def _lookup(self, name: str, layer_prefix: re.Pattern, field: str) -> CheckpointWeight | None:
        m = layer_prefix.fullmatch(name)
        if m is None:
            found = [s for s in self.model_weights if getattr(s, field) == name]
            return CheckpointWeight(found[0]) if found else None
        layer, rest = int(m.group(1)), m.group(2)
        for s in self.layer_weights:
            pattern = getattr(s, field)
            if pattern == rest:  # a GGUF expert tensor: every expert's, stacked
                return CheckpointWeight(s, layer)
            if s.expert and "{e}" in pattern:
                head, tail = pattern.split("{e}")
                index = rest[len(head):len(rest) - len(tail)]
                if rest.startswith(head) and rest.endswith(tail) and index.isdigit():
                    return CheckpointWeight(s, layer, int(index))
        return None

    def lora_targets(self, cfg: ModelConfig) -> dict[str, LoRATarget]:
        """The layers' projections an adapter may update, in table order, with their full
        shapes (their splits give each one's output and input sizes)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {Split.QUERY_ROWS: (q, h), Split.KV_ROWS: (kv, h), Split.INTER_ROWS: (inter, h),
                  Split.QUERY_COLUMNS: (h, q), Split.INTER_COLUMNS: (h, inter)}
        targets = {}
        for s in self.layer_weights:
            if s.param == "weight" and s.split in shapes and not s.expert:
                path = s.hf.removesuffix(".weight")
                name = path.rsplit(".", 1)[-1]
                targets[name] = LoRATarget(name, path, s.module, shapes[s.split])
        return targets

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Each layer's attention kind, transformers' ``layer_types`` spelling."""
        return [SLIDING if w else FULL for w in cfg.attention_windows]


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

_REGISTRY: dict[str, Architecture] = {}
_HF_TYPES: dict[str, str] = {}
_GGUF: dict[tuple[str, bool], str] = {}  # (general.architecture, has experts) -> name


def register(arch: Architecture) -> Architecture:
    if arch.name in _REGISTRY:
        raise ValueError(f"architecture {arch.name!r} is registered already")
    _REGISTRY[arch.name] = arch
    for model_type in arch.hf_model_types:
        _HF_TYPES[model_type] = arch.name
    _GGUF[(arch.gguf_name or arch.name, arch.gguf_experts)] = arch.name
    return arch


def architectures() -> list[str]:
    return sorted(_REGISTRY)


def architecture(name: str, source: str = "the model") -> Architecture:
    """The declaration of GGUF architecture / ``ModelConfig.architecture`` ``name``; a
    ValueError naming ``source`` and the supported ones otherwise."""
    found = _REGISTRY.get(name)
    if found is None:
        raise ValueError(f"unsupported model architecture {name!r} in {source}; "
                         f"supported: {', '.join(architectures())}")
    return found


def gguf_architecture(name: str, experts: bool, source: str) -> Architecture:
    """The declaration of a GGUF file's ``general.architecture`` (``experts``: the file has
    experts, ``{arch}.expert_count`` > 0)."""
    found = _GGUF.get((name, experts))
    if found is None:
        supported = ", ".join(sorted({n for n, _ in _GGUF}))
        what = f"{name!r} with experts" if experts and (name, False) in _GGUF else repr(name)
        raise ValueError(f"unsupported model architecture {what} in {source}; supported: "
                         f"{supported}")
    return _REGISTRY[found]


def hf_architecture(model_type: str, source: str) -> Architecture:
    """The declaration of an HF ``config.json``'s ``model_type``."""
    name = _HF_TYPES.get(model_type)
    if name is None:
        raise ValueError(f"unsupported model architecture {model_type!r} in {source}; "
                         f"supported: {', '.join(sorted(_HF_TYPES))}")
    return _REGISTRY[name]


# --- the Llama family --------------------------------------------------------------------

LLAMA = register(Architecture("llama", ("llama",), "conveyor.model.llama:LlamaForCausalLM",
                              gguf_rope_permuted=True))
QWEN2 = register(Architecture("qwen2", ("qwen2",), "conveyor.model.llama:LlamaForCausalLM",
                              attention_bias=True))
QWEN3 = register(Architecture("qwen3", ("qwen3",), "conveyor.model.llama:LlamaForCausalLM",
                              qk_norm=True))


# --- Gemma 3 (text) ----------------------------------------------------------------------

GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer global (transformers' and llama.cpp's)
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_GLOBAL_ROPE_THETA = 1_000_000.0
# llama.cpp scales the 27B model's attention by 1/sqrt(hidden / heads), not 1/sqrt(head_dim);
# its GGUF says so only through its layer count.
GEMMA3_27B_LAYERS = 62


def _gemma3_from_hf(config: ModelConfig, cfg: dict[str, Any], name: str) -> None:
    """transformers 4.x's rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern, or 5.x's rope_parameters per layer kind and layer_types."""
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


def _gemma3_from_gguf(config: ModelConfig, field: GGUFField) -> None:
    """As llama.cpp reads them: the window from ``attention.sliding_window``, its layout from
    ``attention.sliding_window_pattern`` where the file has it (a period, or a per-layer list of
    booleans), else every sixth layer global; the sliding layers' rope base fixed at 10,000; the
    full layers' ``rope.scaling``."""
    config.sliding_window = int(field("attention.sliding_window", 4096))
    pattern = field("attention.sliding_window_pattern", None)
    config.sliding_window_pattern = (
        window_pattern([SLIDING if bool(p) else FULL for p in pattern], config.num_layers,
                       f"GGUF file {config.name}") if isinstance(pattern, list)
        else int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN))
    config.rope_local_theta = GEMMA3_LOCAL_ROPE_THETA
    kind = field("rope.scaling.type", None)
    if kind not in (None, "none"):
        config.rope_scaling = {"rope_type": kind,
                               "factor": float(field("rope.scaling.factor", 1.0))}
    config.query_pre_attn_scalar = (config.hidden_size // config.num_heads
                                    if config.num_layers == GEMMA3_27B_LAYERS else config.head_dim)
    config.final_logit_softcapping = field("final_logit_softcapping", None)
    config.hidden_activation = "gelu_pytorch_tanh"


# --- mixtures of experts (model/moe.py) ----------------------------------------------------


def _qwen3_moe_from_hf(config: ModelConfig, cfg: dict[str, Any], name: str) -> None:
    """128 experts, top 8, normalized top-k weights in Qwen3-30B-A3B; dense layers where
    ``mlp_only_layers`` or ``decoder_sparse_step`` say."""
    _experts(config, cfg, name, cfg.get("moe_intermediate_size"))
    step = cfg.get("decoder_sparse_step") or 1
    config.dense_mlp_layers = [i for i in range(config.num_layers)
                               if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step]


def _olmoe_from_hf(config: ModelConfig, cfg: dict[str, Any], name: str) -> None:
    """64 experts of ``intermediate_size``, top 8; q and k normed over all heads at once."""
    _experts(config, cfg, name, cfg["intermediate_size"])
    config.qk_norm_whole = True
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"{name}/config.json: clip_qkv is not supported")


def _moe_from_gguf(normalize: bool, expert_size_key: str, qk_norm_whole: bool = False
                   ) -> Callable[[ModelConfig, GGUFField], None]:
    """A mixture of experts' fields from llama.cpp's metadata (``expert_count``,
    ``expert_used_count``, the experts' size under ``expert_size_key``), with the top-k
    normalization llama.cpp applies for the architecture."""
    def read(config: ModelConfig, field: GGUFField) -> None:
        _set_experts(config, int(field("expert_count", 0)), int(field("expert_used_count", 0)),
                     field(expert_size_key, 0) or config.intermediate_size, normalize,
                     f"GGUF file {config.name} needs expert_count >= expert_used_count >= 1")
        config.qk_norm_whole = qk_norm_whole
    return read


def _mixtral_from_hf(config: ModelConfig, cfg: dict[str, Any], name: str) -> None:
    """8 experts of ``intermediate_size``, top 2, the top-k weights always normalized."""
    _experts(config, cfg, name, cfg["intermediate_size"])
    config.norm_topk_prob = True


def _experts(config: ModelConfig, cfg: dict[str, Any], name: str, size: int | None) -> None:
    """The experts' count (``num_experts``, or transformers 5.x's and Mixtral's
    ``num_local_experts``), top k, size and whether the top-k weights are renormalized."""
    if not size:
        raise ValueError(f"{name}/config.json is missing the experts' intermediate size")
    _set_experts(config, cfg.get("num_experts") or cfg.get("num_local_experts"),
                 cfg.get("num_experts_per_tok"), size, bool(cfg.get("norm_topk_prob", False)),
                 f"{name}/config.json needs num_experts >= num_experts_per_tok >= 1")


def _set_experts(config: ModelConfig, count: Any, top_k: Any, size: int, normalize: bool,
                 need: str) -> None:
    """The experts' fields, checked (``need``: what the error says the source lacks)."""
    if not isinstance(count, int) or not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise ValueError(f"{need}, got {count!r} and {top_k!r}")
    config.num_experts, config.num_experts_per_tok = count, top_k
    config.moe_intermediate_size, config.norm_topk_prob = int(size), normalize


_MOE = "conveyor.model.moe:MoEForCausalLM"
QWEN3_MOE = register(Architecture(
    "qwen3_moe", ("qwen3_moe",), _MOE, layer_weights=MOE_LAYER_WEIGHTS, qk_norm=True,
    hf_config=_qwen3_moe_from_hf, gguf_config=_moe_from_gguf(True, "expert_feed_forward_length"),
    decode_layer=None, gguf_name="qwen3moe", gguf_experts=True))
OLMOE = register(Architecture(
    "olmoe", ("olmoe",), _MOE, layer_weights=MOE_LAYER_WEIGHTS, qk_norm=True,
    hf_config=_olmoe_from_hf, gguf_config=_moe_from_gguf(False, "feed_forward_length", True),
    decode_layer=None, gguf_experts=True))
# llama.cpp converts Mixtral as a Llama with experts (its Q/K rows permuted as Llama's)
MIXTRAL = register(Architecture(
    "mixtral", ("mixtral",), _MOE, layer_weights=MIXTRAL_LAYER_WEIGHTS,
    hf_config=_mixtral_from_hf, gguf_config=_moe_from_gguf(True, "feed_forward_length"),
    gguf_rope_permuted=True, decode_layer=None, gguf_name="llama", gguf_experts=True))


GEMMA3 = register(Architecture(
    "gemma3", ("gemma3_text", "gemma3"), "conveyor.model.gemma3:Gemma3ForCausalLM",
    layer_weights=GEMMA3_LAYER_WEIGHTS, model_weights=GEMMA3_MODEL_WEIGHTS, qk_norm=True,
    hf_config=_gemma3_from_hf, gguf_config=_gemma3_from_gguf,
    decode_layer=DecodeLayerKind(activation="gelu_tanh", output_norms=True)))
