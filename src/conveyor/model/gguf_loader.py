"""Read a GGUF file: config from its metadata, dequantized weights with transformers' names.

llama.cpp's converter permutes the rows of Llama's Q and K projections (to interleaved rope
pairs); we undo that so the weights work with the HF "rotate_half" rotary layout.
``read_gguf_blocks`` also returns the 4-bit (Q4_0 / Q4_1) and 8-bit (Q8_0) tensors as their
blocks, undequantized. Given a tensor-parallel ``ShardPlan``, both read only the rank's slice of
each tensor, cut from the file's bytes before anything is dequantized.
"""

from __future__ import annotations

import os
import re
from struct import error as struct_error
from typing import Any

import numpy as np
import torch

from conveyor.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, check_architecture
from conveyor.model.layers.parallel import ShardPlan
from conveyor.model.layers.quantized import GROUP, Int4Blocks, Int8Blocks
from conveyor.model.shard_weights import ZERO_UNLESS_FIRST, weight_slice

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


# A reader opened by a check before loading (``keep=True``), handed to the next open of the
# same unchanged file, so that checking first costs no second parse of the metadata.
_kept: dict[str, tuple[tuple[int, int], Any]] = {}


def open_gguf(path: str, keep: bool = False) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, or a ValueError naming the file and what is wrong
    with it (not a GGUF file, a header or tensors cut short). ``keep``: the next call for this
    file gets this reader instead of parsing it again."""
    import gguf

    stat = os.stat(path)
    version = (stat.st_size, stat.st_mtime_ns)
    kept = _kept.pop(path, None)
    if kept is not None and kept[0] == version:
        return kept[1]
    # gguf's reader maps every tensor as it opens the file, so a file cut short fails here too
    # (with an array shape error that alone would not say which file or why).
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, struct_error) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}): it may be truncated, "
                         "corrupt, or another format") from e
    if keep:
        _kept[path] = (version, reader)
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader: Any, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture", "")
    check_architecture(arch, f"{name} (general.architecture)")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF file {name} is missing metadata {arch}.{key!r}")
        return v

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = [int(x) for x in (eos, eot) if x is not None]
    return ModelConfig(
        name=name,
        architecture=arch,
        num_layers=need("block_count"),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output,
        attention_bias=SUPPORTED_ARCHITECTURES[arch]["attention_bias"],
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: interleaved rope pairs back to two halves per head."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _fix_rows(name: str, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows come first in every array passed; they may
    be a rank's slice of whole heads: the permutation stays within a head)."""
    if cfg.architecture == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", name):
        return _unpermute(arr, arr.shape[0] // cfg.head_dim)
    return arr


def _sliced_data(t: Any, plan: ShardPlan | None, cfg: ModelConfig) -> np.ndarray | None:
    """The tensor's stored data ([rows, bytes or elements]), cut to ``plan``'s slice; None when
    this rank holds zeros (a row-parallel bias off rank 0)."""
    from gguf.constants import GGML_QUANT_SIZES

    data = np.asarray(t.data)
    sl = weight_slice(_hf_name(t.name), plan, cfg.head_dim)
    if sl is None:
        return data
    if sl == ZERO_UNLESS_FIRST:
        return None
    if sl.axis == 0:
        return data[sl.start:sl.stop]
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    if block == 1 and data.dtype.itemsize == type_size:  # plain floats: one column an element
        return data[:, sl.start:sl.stop]
    if sl.start % block or sl.stop % block:
        raise ValueError(f"tensor_parallel_size {plan.size}: GGUF tensor {t.name!r} cannot be "
                         f"split at input {sl.start}, inside a block of {block}")
    return data[:, sl.start // block * type_size: sl.stop // block * type_size]


def read_gguf_blocks(reader: Any, cfg: ModelConfig,
                     plan: ShardPlan | None = None) -> dict[str, Int4Blocks | Int8Blocks]:
    """The Q4_0 / Q4_1 tensors as 4-bit codes, scales and minimums (w = scale * code + min), the
    Q8_0 ones as 8-bit codes and scales (w = scale * code)."""
    from gguf import GGMLQuantizationType as Q

    out: dict[str, Int4Blocks | Int8Blocks] = {}
    for t in reader.tensors:
        if t.tensor_type not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            continue
        raw = _sliced_data(t, plan, cfg)
        if raw is None:
            continue
        rows = raw.shape[0]
        head = 4 if t.tensor_type == Q.Q4_1 else 2  # fp16 d (Q4_1: then fp16 m), then the codes
        code_bytes = GROUP if t.tensor_type == Q.Q8_0 else GROUP // 2
        blocks = raw.reshape(rows, -1, head + code_bytes)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if t.tensor_type == Q.Q8_0:
            codes = blocks[..., head:].copy().view(np.int8).reshape(rows, -1)
            parts = [np.ascontiguousarray(_fix_rows(t.name, a, cfg)) for a in (codes, scale)]
            out[_hf_name(t.name)] = Int8Blocks(*(torch.from_numpy(a) for a in parts))
            continue
        low = (blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
               if t.tensor_type == Q.Q4_1 else -8 * scale)
        nibbles = blocks[..., head:]
        codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, -1)
        parts = [np.ascontiguousarray(_fix_rows(t.name, a, cfg)) for a in (codes, scale, low)]
        out[_hf_name(t.name)] = Int4Blocks(*(torch.from_numpy(a) for a in parts))
    return out


def read_gguf_weights(reader: Any, cfg: ModelConfig,
                      plan: ShardPlan | None = None) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    weights = {}
    for t in reader.tensors:
        data = _sliced_data(t, plan, cfg)
        if data is None:
            weights[_hf_name(t.name)] = torch.zeros(int(np.prod([int(d) for d in t.shape])))
            continue
        try:
            arr = dequantize(data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the "
                             "gguf package cannot dequantize") from e
        shape = (data.shape[0], -1) if len(t.shape) > 1 else (-1,)
        arr = np.array(arr, dtype=np.float32).reshape(shape)
        arr = _fix_rows(t.name, arr, cfg)
        weights[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(arr))  # arr is a fresh copy
    return weights
