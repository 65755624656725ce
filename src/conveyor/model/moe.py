"""Mixtures of experts (Qwen3-MoE, OLMoE, Mixtral): Llama's decoder with each sparse layer's MLP
replaced by a ``SparseMoE`` block.

* The router is a ``Linear`` [experts, hidden]; its logits go through a softmax in float32, each
  token keeps its ``num_experts_per_tok`` most probable experts, and their weights are
  renormalized to sum to one where the config says so (Qwen3-MoE's ``norm_topk_prob``, always
  for Mixtral), as transformers computes them.
* Tokens are grouped by expert: each expert's gate/up and down projections run once, over the
  rows routed to it. They are ``Linear``s, so the loader gives them this device's formats as any
  projection (a GGUF file's blocks under integer compute; the panels in float).
* Each token's output is its k experts' outputs weighted and summed in its top-k order (most
  probable first), one multiply-add at a time: nothing a token computes depends on which other
  tokens share its step, so batching and chunking leave its bits alone wherever each expert's
  projections give a row the same bits at any row count (integer compute, the panels).

The attention and norms are Llama's (Qwen3-MoE's per-head q/k norms, OLMoE's over all heads);
no expert is ever dropped for capacity. Not yet: tensor parallelism, LoRA and the one-call
decode kernel over these layers.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.model.backends.base import Backend
from conveyor.model.config import ModelConfig
from conveyor.model.layers.linear import Linear
from conveyor.model.layers.lora import LoRAContext
from conveyor.model.layers.parallel import TensorParallel
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM


class Expert(nn.Module):
    """One expert: a gated MLP of the experts' intermediate size."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, shards={"gate_proj": inter, "up_proj": inter})
        self.down_proj = Linear(inter, hidden)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)  # the router
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (most probable first) and their weights [T, k] in h's
        dtype."""
        probs = torch.softmax(self.gate(h).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(h.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]."""
        experts, weights = self.route(h)
        t, k = experts.shape
        flat = experts.flatten()  # assignment j = token j // k's (j % k)-th expert
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        outputs = h.new_empty(t * k, h.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start:start + n]
            start += n
            expert = self.experts[e]
            outputs[rows] = expert.down_proj(
                self.backend.silu_and_mul(expert.gate_up_proj(h[rows // k])))
        outputs = outputs.view(t, k, -1)
        out = outputs[:, 0] * weights[:, :1]
        for j in range(1, k):
            out.add_(outputs[:, j] * weights[:, j:j + 1])
        return out


class MoEDecoderLayer(DecoderLayer):
    """A Llama layer whose MLP is a ``SparseMoE`` where ``cfg.sparse_layer(index)`` (else
    Llama's dense MLP: Qwen3-MoE's ``mlp_only_layers``)."""

    def __init__(self, cfg: ModelConfig, backend: Backend, index: int) -> None:
        super().__init__(cfg, backend)
        self.mlp: SparseMoE | None = None
        if cfg.sparse_layer(index):
            self.gate_up_proj = self.down_proj = None
            self.mlp = SparseMoE(cfg, backend)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return super()._mlp(h) if self.mlp is None else self.mlp(h)


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: Backend,
                 rope_freq_factors: torch.Tensor | None = None,
                 tp: TensorParallel | None = None) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError(f"{cfg.architecture}: tensor parallelism over mixture-of-experts "
                             "layers is not supported yet (tensor_parallel_size must be 1)")
        super().__init__(cfg, backend, rope_freq_factors, tp)

    def make_layer(self, cfg: ModelConfig, index: int) -> MoEDecoderLayer:
        return MoEDecoderLayer(cfg, self.backend, index)

    def enable_lora(self, num_slots: int, max_rank: int) -> LoRAContext:
        raise ValueError(f"{self.config.architecture}: LoRA adapters on mixture-of-experts "
                         "models are not supported yet")
