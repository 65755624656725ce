"""Read a GGUF file: config from its metadata, its tensors as ``model/weights.py``'s table names
them, dequantized, and the quantized ones the kernels read also as their blocks: 4-bit (Q4_0 /
Q4_1) and 8-bit (Q8_0) ones unpacked (``layers/quantized.py``), Q5_0 / Q5_1 and the K-quants
(Q4_K / Q5_K / Q6_K) in the file's bytes (``layers/gguf_blocks.py``).

llama.cpp's converter permutes the rows of Llama's Q and K projections (to interleaved rope
pairs); we undo that so the weights work with the HF "rotate_half" rotary layout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from struct import error as struct_error
from typing import Any

import numpy as np
import torch

from conveyor.model.config import (
    FULL,
    GEMMA3_LOCAL_ROPE_THETA,
    GEMMA3_SLIDING_WINDOW_PATTERN,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_architecture,
    window_pattern,
)
from conveyor.model.layers.gguf_blocks import RAW_TYPES, FileBlocks, GGUFBlocks
from conveyor.model.layers.parallel import ShardPlan
from conveyor.model.layers.quantized import GROUP, Int4Blocks, Int8Blocks
from conveyor.model.layers.rotary import gguf_rope_scaling
from conveyor.model.weights import (
    ROPE_FREQS,
    CheckpointTensor,
    WeightSpec,
    gguf_tensor,
    rank_holds,
    rank_slice,
)

# A reader opened by a check before loading (``keep=True``), handed to the next open of the
# same unchanged file, so that checking first costs no second parse of the metadata.
_kept: dict[str, tuple[tuple[int, int], Any]] = {}


def open_gguf(path: str, keep: bool = False) -> Any:
    """A ``gguf.GGUFReader`` over ``path``, or a ValueError naming the file and what is wrong
    with it (not a GGUF file, a header or tensors cut short). ``keep``: the next call for this
    file gets this reader instead of parsing it again."""
    stat = os.stat(path)
    version = (stat.st_size, stat.st_mtime_ns)
    kept = _kept.pop(path, None)
    if kept is not None and kept[0] == version:
        return kept[1]
    # gguf's reader maps every tensor as it opens the file, so a file cut short fails here too
    # (with an array shape error that alone would not say which file or why).
    try:
        reader = _reader_class()(path)
    except (ValueError, IndexError, KeyError, OSError, struct_error) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}): it may be truncated, "
                         "corrupt, or another format") from e
    if keep:
        _kept[path] = (version, reader)
    return reader


@functools.cache
def _reader_class() -> type:
    """``gguf.GGUFReader`` reading its metadata through a plain ndarray view of the file's map.

    The reader cuts every metadata value out of its ``np.memmap`` one slice at a time, and a
    memmap slice costs several microseconds (``__getitem__`` / ``__array_finalize__``): for a
    vocabulary of 262,144 tokens (Gemma 3) that was 13 s of a load, against 3 s from an ndarray
    view of the same map. Same values, same mapped tensors (as ndarrays)."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1,
                 override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            itemsize = np.dtype(dtype).itemsize
            arr = plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return Reader


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
    config = ModelConfig(
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
        rope_scaling=gguf_rope_scaling(lambda key, default: _field(reader, f"{arch}.{key}", default)),
        tie_word_embeddings=not has_output,
        attention_bias=SUPPORTED_ARCHITECTURES[arch]["attention_bias"],
        qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )
    if arch == "gemma3":
        _gemma3_config(reader, config)
    return config


def _gemma3_config(reader: Any, config: ModelConfig) -> None:
    """Gemma 3's fields as llama.cpp reads them: the window from ``gemma3.attention.
    sliding_window``, its layout from ``...sliding_window_pattern`` where the file has it (a
    period, or a per-layer list of booleans), else every sixth layer global; the sliding layers'
    rope base fixed at 10,000; the full layers' ``rope.scaling``; the attention scale
    1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer 27B model."""
    arch = "gemma3"
    config.sliding_window = int(_field(reader, f"{arch}.attention.sliding_window", 4096))
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    config.sliding_window_pattern = (
        window_pattern([SLIDING if bool(p) else FULL for p in pattern], config.num_layers,
                       f"GGUF file {config.name}") if isinstance(pattern, list)
        else int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN))
    config.rope_local_theta = GEMMA3_LOCAL_ROPE_THETA
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        config.rope_scaling = {"rope_type": kind,
                               "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    config.query_pre_attn_scalar = (config.hidden_size // config.num_heads
                                    if config.num_layers == 62 else config.head_dim)
    config.final_logit_softcapping = _field(reader, f"{arch}.final_logit_softcapping")
    config.hidden_activation = "gelu_pytorch_tanh"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: interleaved rope pairs back to two halves per head."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _fix_rows(spec: WeightSpec, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows come first in every array passed; they may
    be a rank's slice of whole heads: the permutation stays within a head)."""
    if cfg.architecture == "llama" and spec.rope_permuted:
        return _unpermute(arr, arr.shape[0] // cfg.head_dim)
    return arr


def _sliced_data(t: Any, spec: WeightSpec, plan: ShardPlan | None,
                 cfg: ModelConfig) -> np.ndarray:
    """The tensor's stored data ([rows, bytes or elements]), cut to ``plan``'s slice."""
    from gguf.constants import GGML_QUANT_SIZES

    data = np.asarray(t.data)
    sl = rank_slice(spec, plan, cfg.head_dim)
    if sl is None:
        return data
    if sl.axis == 0:
        return data[sl.start:sl.stop]
    block, type_size = GGML_QUANT_SIZES[t.tensor_type]
    if block == 1 and data.dtype.itemsize == type_size:  # plain floats: one column an element
        return data[:, sl.start:sl.stop]
    if sl.start % block or sl.stop % block:
        raise ValueError(f"tensor_parallel_size {plan.size}: GGUF tensor {t.name!r} cannot be "
                         f"split at input {sl.start}, inside a block of {block}")
    return data[:, sl.start // block * type_size: sl.stop // block * type_size]


def _blocks(t: Any, raw: np.ndarray, spec: WeightSpec,
            cfg: ModelConfig) -> FileBlocks | None:
    """A Q4_0 / Q4_1 tensor as 4-bit codes, scales and minimums (w = scale * code + min), a
    Q8_0 one as 8-bit codes and scales (w = scale * code), a Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K
    one as its bytes; None for other types (and 1-D tensors)."""
    from gguf import GGMLQuantizationType as Q

    if raw.ndim != 2:
        return None
    if t.tensor_type in RAW_TYPES:
        # a copy: raw may be a read-only view of the mapped file
        return GGUFBlocks.from_file(int(t.tensor_type),
                                    torch.from_numpy(np.array(_fix_rows(spec, raw, cfg))))
    if t.tensor_type not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return None
    rows = raw.shape[0]
    head = 4 if t.tensor_type == Q.Q4_1 else 2  # fp16 d (Q4_1: then fp16 m), then the codes
    code_bytes = GROUP if t.tensor_type == Q.Q8_0 else GROUP // 2
    blocks = raw.reshape(rows, -1, head + code_bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.tensor_type == Q.Q8_0:
        codes = blocks[..., head:].copy().view(np.int8).reshape(rows, -1)
        parts = [np.ascontiguousarray(_fix_rows(spec, a, cfg)) for a in (codes, scale)]
        return Int8Blocks(*(torch.from_numpy(a) for a in parts))
    low = (blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
           if t.tensor_type == Q.Q4_1 else -8 * scale)
    nibbles = blocks[..., head:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, -1)
    parts = [np.ascontiguousarray(_fix_rows(spec, a, cfg)) for a in (codes, scale, low)]
    return Int4Blocks(*(torch.from_numpy(a) for a in parts))


def _dequantized(t: Any, data: np.ndarray, spec: WeightSpec, cfg: ModelConfig) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the "
                         "gguf package cannot dequantize") from e
    shape = (data.shape[0], -1) if len(t.shape) > 1 else (-1,)
    arr = _fix_rows(spec, np.array(arr, dtype=np.float32).reshape(shape), cfg)
    return torch.from_numpy(np.ascontiguousarray(arr))  # arr is a fresh copy


def read_gguf_rope_freqs(reader: Any) -> torch.Tensor | None:
    """llama 3's rope frequency factors, where the file has them."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            return torch.from_numpy(np.array(dequantize(np.asarray(t.data), t.tensor_type),
                                             dtype=np.float32).reshape(-1))
    return None


def read_gguf_tensors(reader: Any, cfg: ModelConfig, plan: ShardPlan | None = None,
                      blocks: bool = False) -> Iterator[CheckpointTensor]:
    """Every tensor of the file (but the rope factors) in the table of ``model/weights.py``,
    dequantized to float32, one at a time; with a tensor-parallel ``plan`` only this rank's
    slice of each, cut from the file's bytes before anything is dequantized. ``blocks``: the
    quantized tensors the kernels read come with their blocks too, undequantized."""
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        weight = gguf_tensor(t.name, cfg.architecture)
        if weight is None:
            raise ValueError(f"unknown GGUF tensor {t.name!r}")
        if not rank_holds(weight.spec, plan):
            continue
        data = _sliced_data(t, weight.spec, plan, cfg)
        yield CheckpointTensor(weight, _dequantized(t, data, weight.spec, cfg),
                               _blocks(t, data, weight.spec, cfg) if blocks else None)
