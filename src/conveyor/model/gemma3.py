"""Gemma 3 (text): the Llama decoder's layers with Gemma's differences.

* Layers alternate local and global attention: five sliding-window layers (a token attends to
  the last ``sliding_window`` positions, its own included) for each global one (the whole
  context), each kind with its own rotary base (10,000 local; the config's ``rope_theta`` and
  ``rope_scaling`` global).
* Four RMSNorms a layer: the attention's and the MLP's inputs (fused with the residual adds, as
  Llama's) and their outputs, before those adds; q and k are RMS-normed per head before the
  rotary. Gemma scales a norm by ``1 + w``: the norms hold ``1 + w`` (as llama.cpp's GGUF stores
  it; a safetensors checkpoint's w gets the 1 on load, ``model/weights.py``), so they are plain
  RMSNorms here.
* The MLP gates with GeLU (tanh approximation) where Llama has SiLU.
* The embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers
  does); the lm_head is tied to it. Attention scales by ``query_pre_attn_scalar**-0.5``; the
  final logits are tanh-capped where the config says so.
"""

from __future__ import annotations

import torch

from conveyor.model.backends.base import Backend, StepMetadata
from conveyor.model.config import ModelConfig
from conveyor.model.layers.norm import RMSNorm
from conveyor.model.layers.parallel import TensorParallel
from conveyor.model.layers.rotary import RotaryEmbedding, rope_inv_freq
from conveyor.model.llama import DecoderLayer, LlamaForCausalLM

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the activation
LOCAL_ROTARY = 1  # the sliding layers' rotary_index: rotaries[1] in run_layers


class Gemma3DecoderLayer(DecoderLayer):
    """``post_norm`` is the MLP's input norm (Gemma's pre_feedforward_layernorm), as in Llama;
    ``post_attention_norm`` and ``post_feedforward_norm`` norm the two outputs."""

    def __init__(self, cfg: ModelConfig, backend: Backend, index: int,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(cfg, backend, tp)
        self.window = cfg.layer_window(index)
        self.scale = cfg.attention_scale
        # the sliding layers' rotary is the model's local_rotary (Gemma3ForCausalLM.run_layers)
        self.rotary_index = LOCAL_ROTARY if self.window is not None else 0
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_feedforward_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        """The residual stream is ``residual`` (updated in place) + ``x``; returns the new ``x``
        (the MLP's normed output). ``cos``, ``sin``: this layer's kind's rotary."""
        attn = self._attention(self.input_norm(x, residual, out=x), cos, sin, k_cache, v_cache,
                               meta)
        attn = self.post_attention_norm(attn)
        return self.post_feedforward_norm(self._mlp(self.post_norm(attn, residual, out=attn)))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up``."""
        return self.backend.gelu_tanh_and_mul(gate_up)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: Backend,
                 rope_freq_factors: torch.Tensor | None = None,
                 tp: TensorParallel | None = None) -> None:
        if cfg.hidden_activation not in GELU_TANH:
            raise ValueError(f"Gemma 3 with hidden_activation {cfg.hidden_activation!r} is not "
                             f"supported (only {', '.join(GELU_TANH)})")
        super().__init__(cfg, backend, rope_freq_factors, tp)
        # self.rotary (built by LlamaForCausalLM from rope_theta and rope_scaling) is the global
        # layers'; the sliding layers' has its own base and no scaling.
        self.local_rotary = RotaryEmbedding(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta
                                                          or 10_000.0, None))
        self.embed_scale = cfg.hidden_size ** 0.5

    def rotary_to(self, device: torch.device) -> None:
        super().rotary_to(device)
        self.local_rotary.to(device)

    def make_layer(self, cfg: ModelConfig, index: int) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(cfg, self.backend, index, self.tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().embed(input_ids)
        return rows * torch.tensor(self.embed_scale, dtype=rows.dtype, device=rows.device)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: StepMetadata) -> torch.Tensor:
        """Each layer with its kind's rotary (the global layers' or the sliding ones', by its
        ``rotary_index``) and its KV-cache group's metadata; a decode step in one call where the
        fused layers serve it (``decode_in_one_call``)."""
        rotaries = [self.rotary.cos_sin(positions, residual.dtype),
                    self.local_rotary.cos_sin(positions, residual.dtype)]
        out = self.decode_in_one_call(x, residual, rotaries, kv_caches, meta)
        if out is not None:
            return out
        for layer, (k_cache, v_cache), layer_meta in zip(self.layers, kv_caches,
                                                         meta.per_layer(len(self.layers)),
                                                         strict=True):
            cos, sin = rotaries[layer.rotary_index]
            x = layer(x, residual, cos, sin, k_cache, v_cache, layer_meta)
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        logits_indices: torch.Tensor,
        hidden_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor] | None:
        """As ``LlamaForCausalLM.forward``, the logits tanh-capped where the config says so."""
        out = super().forward(input_ids, positions, kv_caches, meta, logits_indices,
                              hidden_indices)
        cap = self.config.final_logit_softcapping
        if not cap:
            return out
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        if logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if hidden_indices is None else (logits, hidden)

