"""The Llama-family decoder (Llama / SmolLM2, Qwen2 with QKV bias, Qwen3 with q/k RMSNorm).

Inference only, over a paged KV cache. Projections are fused (one QKV matmul, one gate/up
matmul) and logits are computed only for the positions that sample. ``gemma3.py`` builds Gemma 3
from these layers.
The loader (``model/loader.py``) fills the weights, as ``model/weights.py``'s table names them,
and lays them out for the device. Under tensor parallelism (``tp``) each rank builds its
shard's shapes and its weights come in already sliced (``layers/parallel.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.model.backends.base import Backend, StepMetadata
from conveyor.model.config import ModelConfig
from conveyor.model.kernels.decode_layer import DecodeLayers, decode_layers
from conveyor.model.layers.embedding import VocabEmbedding
from conveyor.model.layers.linear import Linear
from conveyor.model.layers.lora import LoRAContext, LoRALayer
from conveyor.model.layers.norm import RMSNorm
from conveyor.model.layers.parallel import (
    TensorParallel,
    row_parallel_linear,
    shard_plan,
    vocab_parallel_rows,
)
from conveyor.model.layers.rotary import RotaryEmbedding
from conveyor.model.registry import architecture
from conveyor.model.weights import rank_slice

MLP_CHUNK_TOKENS = 1024


def kv_cache_groups(layer_metadata: list[StepMetadata]) -> tuple[list[StepMetadata], list[int]]:
    """A hybrid KV cache's per-layer metadata as its groups' (each distinct object, in the order
    of first use) and each layer's index among them."""
    groups: list[StepMetadata] = []
    index: dict[int, int] = {}
    layer_groups = []
    for m in layer_metadata:
        i = index.setdefault(id(m), len(groups))
        if i == len(groups):
            groups.append(m)
        layer_groups.append(i)
    return groups, layer_groups


class DecoderLayer(nn.Module):
    # What the attention is given: a sliding window (None: the whole context) and a scale
    # (None: head_dim**-0.5). A Llama layer has neither; Gemma 3's layers set them.
    window: int | None = None
    scale: float | None = None
    # Which of the model's rotary tables the layer takes (``run_layers``' ``rotaries``): 0, the
    # model's ``rotary``; Gemma 3's sliding layers take 1, its ``local_rotary``.
    rotary_index: int = 0

    def __init__(self, cfg: ModelConfig, backend: Backend,
                 tp: TensorParallel | None = None) -> None:
        """``cfg``: this rank's shapes (its heads, KV heads and intermediate columns)."""
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias,
                               shards={"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size})
        self.o_proj = row_parallel_linear(q_size, cfg.hidden_size, tp)
        # q/k norms per head (Qwen3, Gemma 3), or over all heads at once (OLMoE)
        self.qk_norm_whole = cfg.qk_norm_whole
        q_norm, k_norm = (q_size, kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_norm, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_norm, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter,
                                   shards={"gate_proj": inter, "up_proj": inter})
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        """The residual stream is ``residual`` (updated in place) + ``x``; returns the new ``x``."""
        # x is dead once added to the residual, so each norm writes its result over its input.
        attn = self._attention(self.input_norm(x, residual, out=x), cos, sin, k_cache, v_cache,
                               meta)
        return self._mlp(self.post_norm(attn, residual, out=attn))

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, o, gate_up, down: the order of ``kernels/decode_layer.PROJECTIONS``."""
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    def decode_lora(self) -> list[LoRALayer]:
        """This layer's LoRA stacks for ``kernels/decode_layer.cpp``, per projection in its
        order (after ``LlamaForCausalLM.enable_lora``)."""
        if any(p.lora is None for p in self.projections):
            raise ValueError("LoRA is not enabled on this layer")
        return [p.lora for p in self.projections]

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: StepMetadata) -> torch.Tensor:
        # Its own function so that q, k, v and friends are freed before the MLP runs.
        t, heads, qk_size = h.shape[0], self.num_heads, self.q_size + self.kv_size
        qkv = self.qkv_proj(h)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q's and k's heads are rotated in one pass, over qkv itself: no new tensors.
            qk = qkv[:, :qk_size].view(t, heads + self.num_kv_heads, self.head_dim)
            qk = self.backend.rotary(qk, cos, sin, out=qk)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = self._qk_norms(qkv[:, :self.q_size], qkv[:, self.q_size:qk_size], t)
            q, k = self.backend.rotary(q, cos, sin), self.backend.rotary(k, cos, sin)
        # h is dead once projected: the attention output goes over it (same shape in Llama).
        return self.o_proj(self.backend.attention(q, k, v, k_cache, v_cache, meta, out=h,
                                                  window=self.window, scale=self.scale))

    def _qk_norms(self, q: torch.Tensor, k: torch.Tensor,
                  t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ([T, heads * head_dim] views of qkv) normed per head, or over all heads at
        once, as [T, heads, head_dim]."""
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qk_norm_whole:
            return (self.q_norm(q.contiguous()).view(t, heads, d),
                    self.k_norm(k.contiguous()).view(t, kv_heads, d))
        return self.q_norm(q.view(t, heads, d)), self.k_norm(k.view(t, kv_heads, d))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of a fused [T, gate | up] row: ``silu(gate) * up``."""
        return self.backend.silu_and_mul(gate_up)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        lora = self.gate_up_proj.lora
        if h.shape[0] <= MLP_CHUNK_TOKENS or (lora is not None and lora.context.active):
            # (LoRA rows are numbered over the whole step)
            return self.down_proj(self._act(self.gate_up_proj(h)))
        # A long prefill's [T, 2 * intermediate] activations are the step's largest; a chunk at a
        # time bounds them (peak RSS) at no cost: the panel GEMM works in blocks of 192 rows
        # anyway, and oneDNN is no faster per row on longer calls. Each chunk's
        # output goes over its own input rows, which gate_up has finished reading.
        for chunk in h.split(MLP_CHUNK_TOKENS):
            chunk.copy_(self.down_proj(self._act(self.gate_up_proj(chunk))))
        return h


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend,
                 rope_freq_factors: torch.Tensor | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.plan = (shard_plan(cfg, tp.rank, tp.size, tp.whole_sums) if self.tp is not None
                     else None)
        local = self.plan.local_config(cfg) if self.plan is not None else cfg
        vocab = (self.plan.vocab_end - self.plan.vocab_start if self.plan is not None
                 else cfg.vocab_size)
        self.embed_tokens = VocabEmbedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(local, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.lm_head = Linear(cfg.hidden_size, vocab)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens)
        self.rotary = RotaryEmbedding.of(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                         rope_freq_factors, cfg.max_position_embeddings)
        self.fused_decode: DecodeLayers | None = None  # see fused_decode.py
        self.lora: LoRAContext | None = None  # see enable_lora

    def rotary_to(self, device: torch.device) -> None:
        """The rotary frequencies onto ``device`` (they are no parameters: ``.to`` skips them)."""
        self.rotary.to(device)

    def make_layer(self, cfg: ModelConfig, index: int) -> DecoderLayer:
        """Layer ``index`` of this rank's shapes ``cfg``."""
        return DecoderLayer(cfg, self.backend, self.tp)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        logits_indices: torch.Tensor,  # [S] flat token indices whose logits are wanted
        hidden_indices: torch.Tensor | None = None,  # [P] flat token indices to pool
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor] | None:
        """Returns logits [S, vocab] in the model's dtype (the sampler upcasts when it must);
        under tensor parallelism on rank 0 only (None on the others). With ``hidden_indices``:
        ``(logits, hidden)``, ``hidden`` [P, hidden_size] the final-norm hidden states there
        in float32 (what pooling reads)."""
        # Residual stream = residual + x, kept as two tensors so each norm can fuse the add.
        residual = self.embed(input_ids)
        x = self.run_layers(torch.zeros_like(residual), residual, positions, kv_caches, meta)
        hidden = None
        if hidden_indices is not None:  # before the logits' norm, which writes over x
            hidden = self.norm(x[hidden_indices], residual[hidden_indices]).float()
        x = self.norm(x[logits_indices], residual[logits_indices])
        logits = self.lm_head(x)
        if self.tp is not None:
            logits = self.tp.gather_to_first(logits, self.config.vocab_size)
        return logits if hidden is None else (logits, hidden)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: StepMetadata) -> torch.Tensor:
        """Every layer over the residual stream ``residual + x``; returns the last ``x``."""
        cos, sin = rotary = self.rotary.cos_sin(positions, residual.dtype)
        out = self.decode_in_one_call(x, residual, [rotary], kv_caches, meta)
        if out is not None:
            return out
        for layer, (k_cache, v_cache), layer_meta in zip(self.layers, kv_caches,
                                                         meta.per_layer(len(self.layers)),
                                                         strict=True):
            x = layer(x, residual, cos, sin, k_cache, v_cache, layer_meta)
        return x

    def decode_in_one_call(self, x: torch.Tensor, residual: torch.Tensor,
                           rotaries: list[tuple[torch.Tensor, torch.Tensor]],
                           kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                           meta: StepMetadata) -> torch.Tensor | None:
        """``run_layers``' result through the one-call decode layers (``fused_decode``), or None
        where they do not serve the step: not every token a decode, more rows than their blocks
        serve, or a cache of another dtype (a float32 model's may be bf16). ``rotaries``: the
        (cos, sin) of each ``DecoderLayer.rotary_index``; a hybrid KV cache's groups each bring
        their own slots, tables and context lengths (``meta.layer_metadata``)."""
        fused = self.fused_decode
        if (fused is None or not meta.decode_only or not fused.serves(x.shape[0])
                or kv_caches[0][0].dtype != x.dtype):
            return None
        groups, layer_groups = [meta], []
        if meta.layer_metadata is not None:
            groups, layer_groups = kv_cache_groups(meta.layer_metadata)
            if not all(g.decode_only for g in groups):
                return None
        lora_slots = self.lora.slots if self.lora is not None else None
        return decode_layers(fused, x, residual, [cos for cos, _ in rotaries],
                             [sin for _, sin in rotaries], kv_caches,
                             [g.slot_mapping for g in groups], [g.block_tables for g in groups],
                             [g.context_lens for g in groups], lora_slots, layer_groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def enable_lora(self, num_slots: int, max_rank: int) -> LoRAContext:
        """Give every projection a ``LoRALayer`` of ``num_slots`` adapter slots of rank up to
        ``max_rank``, over one shared context (the step's slot per row); adapters come with
        ``set_lora_slot``."""
        if self.lora is not None:
            raise ValueError("LoRA is already enabled on this model")
        self.lora = LoRAContext(num_slots)
        device = self.norm.weight.device
        for layer in self.layers:
            q, kv = layer.q_size, layer.kv_size
            inter = layer.gate_up_proj.out_features // 2
            hidden = self.config.hidden_size
            o, down = layer.o_proj, layer.down_proj  # (under whole sums: a slice of hidden)
            layer.qkv_proj.lora = LoRALayer(self.lora, {
                "q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)},
                hidden, max_rank, device)
            layer.o_proj.lora = LoRALayer(self.lora, {"o_proj": (0, o.out_features)},
                                          o.in_features, max_rank, device)
            layer.gate_up_proj.lora = LoRALayer(self.lora, {
                "gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}, hidden, max_rank,
                device)
            layer.down_proj.lora = LoRALayer(self.lora, {"down_proj": (0, down.out_features)},
                                             down.in_features, max_rank, device)
        if self.fused_decode is not None:
            self.fused_decode.set_lora([layer.decode_lora() for layer in self.layers])
        return self.lora

    def set_lora_slot(self, slot: int,
                      weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> None:
        """Hold an adapter in ``slot`` (after ``enable_lora``): per (layer, module name) its A
        [r, in] and B [out, r] (``conveyor.lora.adapter``), ``scale`` folded into B; replaces
        what the slot held (empty ``weights``: clears it)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this model (enable_lora)")
        arch = architecture(self.config.architecture)
        targets = arch.lora_targets(self.config)
        parts: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (i, module), (a, b) in weights.items():
            target = targets[module]
            if self.plan is not None:  # B's rows of a column-parallel projection, else A's columns
                spec = arch.hf_tensor(f"model.layers.{i}.{target.path}.weight").spec
                part = rank_slice(spec, self.plan, self.config.head_dim)
                if part is not None and part.axis == 0:
                    b = b[part.start:part.stop]
                elif part is not None:
                    a = a[:, part.start:part.stop]
            parts.setdefault((i, target.module), {})[module] = (a, b * scale)
        modules = dict.fromkeys(t.module for t in targets.values())
        for i, layer in enumerate(self.layers):
            for name in modules:
                getattr(layer, name).lora.set_slot(slot, parts.get((i, name), {}))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return vocab_parallel_rows(self.embed_tokens, input_ids, self.plan, self.tp)
        return self.embed_tokens(input_ids)

    def num_params(self) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        return total
