"""The checkpoint-name tables an architecture's declaration names (``model/registry.py``; the
Llama family's, Gemma 3's): each tensor's name in transformers' safetensors and in llama.cpp's
GGUF, the parameter of the model it loads into (and its part of a stacked projection: q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``), and how tensor parallelism splits it
(``layers/parallel.py``).

Loaders look each tensor up in the table before reading it (``Architecture.gguf_tensor``,
``hf_tensor``), so a rank
reads, and for GGUF dequantizes, only its slice (``rank_slice``): its peak memory is about 1/N
of the weights, not all of them. Shapes are [out, in] as transformers stores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from conveyor.model.layers.gguf_blocks import GGUFBlocks
from conveyor.model.layers.parallel import ShardPlan


class Split(Enum):
    """Which part of a tensor a tensor-parallel rank holds: the rows or the columns of its
    query heads, KV heads, intermediate columns or vocabulary range, all of it, or (a
    row-parallel projection's bias, added once after the all-reduce) all of it on rank 0 only.
    Under whole sums (``ShardPlan.whole_sums``) the row-parallel projections' weights
    (``QUERY_COLUMNS``, ``INTER_COLUMNS``) and biases (``FIRST_RANK``) are split by their
    output rows instead: each rank holds its slice of the hidden features, of the whole input."""
    REPLICATED = "replicated"
    FIRST_RANK = "first rank"
    VOCAB_ROWS = "vocab rows"
    QUERY_ROWS = "query rows"
    KV_ROWS = "kv rows"
    INTER_ROWS = "intermediate rows"
    QUERY_COLUMNS = "query columns"
    INTER_COLUMNS = "intermediate columns"


@dataclass(frozen=True)
class WeightSpec:
    """A checkpoint tensor (per layer; an expert's names and module hold ``{e}``, its index)."""
    hf: str  # transformers' name
    gguf: str  # llama.cpp's name
    module: str  # the module of the model that holds it
    param: str  # "weight" or "bias"
    shard: str | None = None  # its rows of a stacked projection (``Linear.shards``)
    split: Split = Split.REPLICATED
    # llama.cpp's converter interleaves the rope pairs of each head's rows (Llama's Q and K)
    rope_permuted: bool = False
    optional: bool = False  # a checkpoint may lack it (biases)
    # Gemma's norms scale by (1 + w): transformers stores w, llama.cpp's converter (and so the
    # model's parameter) 1 + w; a safetensors checkpoint's tensor gets the 1 added on load.
    hf_plus_one: bool = False
    # one of a mixture-of-experts layer's experts: one tensor per expert in transformers' files
    # (``{e}`` in hf), one [experts, out, in] tensor in llama.cpp's
    expert: bool = False


_Q, _KV = Split.QUERY_ROWS, Split.KV_ROWS

LAYER_WEIGHTS = (
    WeightSpec("input_layernorm.weight", "attn_norm.weight", "input_norm", "weight"),
    WeightSpec("post_attention_layernorm.weight", "ffn_norm.weight", "post_norm", "weight"),
    WeightSpec("self_attn.q_proj.weight", "attn_q.weight", "qkv_proj", "weight", "q_proj", _Q,
               rope_permuted=True),
    WeightSpec("self_attn.k_proj.weight", "attn_k.weight", "qkv_proj", "weight", "k_proj", _KV,
               rope_permuted=True),
    WeightSpec("self_attn.v_proj.weight", "attn_v.weight", "qkv_proj", "weight", "v_proj", _KV),
    WeightSpec("self_attn.q_proj.bias", "attn_q.bias", "qkv_proj", "bias", "q_proj", _Q,
               rope_permuted=True, optional=True),
    WeightSpec("self_attn.k_proj.bias", "attn_k.bias", "qkv_proj", "bias", "k_proj", _KV,
               rope_permuted=True, optional=True),
    WeightSpec("self_attn.v_proj.bias", "attn_v.bias", "qkv_proj", "bias", "v_proj", _KV,
               optional=True),
    WeightSpec("self_attn.o_proj.weight", "attn_output.weight", "o_proj", "weight",
               split=Split.QUERY_COLUMNS),
    WeightSpec("self_attn.o_proj.bias", "attn_output.bias", "o_proj", "bias",
               split=Split.FIRST_RANK, optional=True),
    WeightSpec("self_attn.q_norm.weight", "attn_q_norm.weight", "q_norm", "weight"),
    WeightSpec("self_attn.k_norm.weight", "attn_k_norm.weight", "k_norm", "weight"),
    WeightSpec("mlp.gate_proj.weight", "ffn_gate.weight", "gate_up_proj", "weight", "gate_proj",
               Split.INTER_ROWS),
    WeightSpec("mlp.up_proj.weight", "ffn_up.weight", "gate_up_proj", "weight", "up_proj",
               Split.INTER_ROWS),
    WeightSpec("mlp.down_proj.weight", "ffn_down.weight", "down_proj", "weight",
               split=Split.INTER_COLUMNS),
)
MODEL_WEIGHTS = (
    WeightSpec("model.embed_tokens.weight", "token_embd.weight", "embed_tokens", "weight",
               split=Split.VOCAB_ROWS),
    WeightSpec("model.norm.weight", "output_norm.weight", "norm", "weight"),
    WeightSpec("lm_head.weight", "output.weight", "lm_head", "weight", split=Split.VOCAB_ROWS),
)

def moe_weights(block: str, experts: tuple[str, str, str]) -> tuple[WeightSpec, ...]:
    """A sparse MoE block's tensors (``model/moe.py``): its router (``{block}.gate``) and each
    expert's gate, up and down projections, named ``experts`` in transformers' files."""
    gate, up, down = experts
    prefix = f"{block}.experts.{{e}}"
    return (
        WeightSpec(f"{block}.gate.weight", "ffn_gate_inp.weight", "mlp.gate", "weight"),
        WeightSpec(f"{prefix}.{gate}.weight", "ffn_gate_exps.weight", "mlp.experts.{e}.gate_up_proj",
                   "weight", "gate_proj", Split.INTER_ROWS, expert=True),
        WeightSpec(f"{prefix}.{up}.weight", "ffn_up_exps.weight", "mlp.experts.{e}.gate_up_proj",
                   "weight", "up_proj", Split.INTER_ROWS, expert=True),
        WeightSpec(f"{prefix}.{down}.weight", "ffn_down_exps.weight", "mlp.experts.{e}.down_proj",
                   "weight", split=Split.INTER_COLUMNS, expert=True),
    )


# A mixture of experts' layers (Qwen3-MoE, OLMoE, Mixtral): Llama's attention and norms, then the
# sparse block; Qwen3-MoE's dense layers (``mlp_only_layers``) keep Llama's MLP.
_ATTENTION_WEIGHTS = tuple(s for s in LAYER_WEIGHTS if s.module not in ("gate_up_proj", "down_proj"))
MOE_LAYER_WEIGHTS = (*LAYER_WEIGHTS, *moe_weights("mlp", ("gate_proj", "up_proj", "down_proj")))
MIXTRAL_LAYER_WEIGHTS = (*_ATTENTION_WEIGHTS, *moe_weights("block_sparse_moe", ("w1", "w3", "w2")))


def _gemma_norm(hf: str, gguf: str, module: str) -> WeightSpec:
    return WeightSpec(hf, gguf, module, "weight", hf_plus_one=True)


# Gemma 3: four norms a layer (the attention's and the MLP's outputs are normed before their
# residual adds; ``post_norm`` is the norm before the MLP, as Llama's), q/k norms, no biases;
# llama.cpp leaves its Q and K rows as they are (neox rope).
GEMMA3_LAYER_WEIGHTS = (
    _gemma_norm("input_layernorm.weight", "attn_norm.weight", "input_norm"),
    _gemma_norm("post_attention_layernorm.weight", "post_attention_norm.weight",
                "post_attention_norm"),
    _gemma_norm("pre_feedforward_layernorm.weight", "ffn_norm.weight", "post_norm"),
    _gemma_norm("post_feedforward_layernorm.weight", "post_ffw_norm.weight",
                "post_feedforward_norm"),
    _gemma_norm("self_attn.q_norm.weight", "attn_q_norm.weight", "q_norm"),
    _gemma_norm("self_attn.k_norm.weight", "attn_k_norm.weight", "k_norm"),
    *(s for s in LAYER_WEIGHTS
      if s.module in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") and s.param == "weight"),
)
GEMMA3_MODEL_WEIGHTS = (
    MODEL_WEIGHTS[0],
    _gemma_norm("model.norm.weight", "output_norm.weight", "norm"),
    MODEL_WEIGHTS[2],
)

# Not a parameter: llama 3's rope frequency factors in a GGUF file, which the model is built with.
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class CheckpointWeight:
    """A checkpoint tensor found in the table: its spec and its layer (None: not a layer's)."""
    spec: WeightSpec
    layer: int | None = None
    expert: int | None = None  # an expert's tensor: which expert

    @property
    def name(self) -> str:
        """transformers' name, which messages use whatever the file."""
        hf = self.spec.hf.format(e=self.expert) if self.spec.expert else self.spec.hf
        return hf if self.layer is None else f"model.layers.{self.layer}.{hf}"

    @property
    def module(self) -> str:
        module = self.spec.module.format(e=self.expert) if self.spec.expert else self.spec.module
        return module if self.layer is None else f"layers.{self.layer}.{module}"


@dataclass
class CheckpointTensor:
    """One tensor as a loader read it, this rank's slice: dense (float32), or where a GGUF file
    stores it as blocks the kernels read (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K /
    Q6_K) and the loader was asked for them, those blocks alone, undequantized."""
    weight: CheckpointWeight
    dense: torch.Tensor | None
    blocks: GGUFBlocks | None = None


@dataclass(frozen=True)
class WeightSlice:
    axis: int  # 0: output rows, 1: input columns
    start: int
    stop: int


# Row-parallel projections' tensors: split by output rows under whole sums
_ROW_PARALLEL = (Split.QUERY_COLUMNS, Split.INTER_COLUMNS, Split.FIRST_RANK)


def rank_holds(spec: WeightSpec, plan: ShardPlan | None) -> bool:
    """Whether ``plan``'s rank loads the tensor at all (a row-parallel bias: rank 0 only, but
    under whole sums every rank its rows)."""
    return (plan is None or spec.split is not Split.FIRST_RANK or plan.rank == 0
            or plan.whole_sums)


def rank_slice(spec: WeightSpec, plan: ShardPlan | None, head_dim: int) -> WeightSlice | None:
    """The slice of the tensor that ``plan``'s rank holds; None for the whole tensor
    (replicated, or no plan)."""
    if plan is None or plan.size == 1:
        return None
    if plan.whole_sums and spec.split in _ROW_PARALLEL:
        return WeightSlice(0, plan.rank * plan.hidden, (plan.rank + 1) * plan.hidden)
    if spec.split in (Split.REPLICATED, Split.FIRST_RANK):
        return None
    q_start = plan.rank * plan.num_heads * head_dim
    query = (q_start, q_start + plan.num_heads * head_dim)
    i_start = plan.rank * plan.intermediate
    intermediate = (i_start, i_start + plan.intermediate)
    kv_start = plan.kv_head_start * head_dim
    ranges = {
        Split.VOCAB_ROWS: (0, (plan.vocab_start, plan.vocab_end)),
        Split.QUERY_ROWS: (0, query),
        Split.KV_ROWS: (0, (kv_start, kv_start + plan.num_kv_heads * head_dim)),
        Split.INTER_ROWS: (0, intermediate),
        Split.QUERY_COLUMNS: (1, query),
        Split.INTER_COLUMNS: (1, intermediate),
    }
    axis, (start, stop) = ranges[spec.split]
    return WeightSlice(axis, start, stop)
