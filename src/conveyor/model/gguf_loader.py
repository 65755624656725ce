"""Read a GGUF file: config from its metadata (through the architecture's declaration,
``model/registry.py``), its tensors as the architecture's table names them: the quantized ones
the kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K / Q5_K / Q6_K) as the file's
bytes (``layers/gguf_blocks.py``'s ``GGUFBlocks``, parsed once, never dequantized) when the
loader keeps blocks, the others dequantized to float32.

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

from conveyor.model.config import ModelConfig
from conveyor.model.layers.gguf_blocks import LAYOUTS, GGUFBlocks
from conveyor.model.layers.parallel import ShardPlan
from conveyor.model.layers.rotary import gguf_rope_scaling
from conveyor.model.registry import architecture, gguf_architecture
from conveyor.model.weights import (
    ROPE_FREQS,
    CheckpointTensor,
    CheckpointWeight,
    WeightSpec,
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
    declared = gguf_architecture(arch, bool(_field(reader, f"{arch}.expert_count")),
                                 f"{name} (general.architecture)")

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
        architecture=declared.name,
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
        attention_bias=declared.attention_bias,
        qk_norm=declared.qk_norm,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )
    if declared.gguf_config is not None:
        declared.gguf_config(config, lambda key, default: _field(reader, f"{arch}.{key}", default))
    if config.num_experts:  # a layer without a router keeps a dense MLP (Qwen3-MoE's may)
        names = {t.name for t in reader.tensors}
        config.dense_mlp_layers = [i for i in range(config.num_layers)
                                   if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return config


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: interleaved rope pairs back to two halves per head."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _fix_rows(spec: WeightSpec, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows come first in every array passed; they may
    be a rank's slice of whole heads: the permutation stays within a head)."""
    if spec.rope_permuted and architecture(cfg.architecture).gguf_rope_permuted:
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


def _blocks(t: Any, raw: np.ndarray, spec: WeightSpec, cfg: ModelConfig) -> GGUFBlocks | None:
    """The tensor's bytes as ``GGUFBlocks`` (its rows unpermuted where llama.cpp permuted
    them); None for types without a kernel here (and 1-D tensors)."""
    if raw.ndim != 2 or int(t.tensor_type) not in LAYOUTS:
        return None
    # a copy: raw may be a read-only view of the mapped file
    return GGUFBlocks.from_file(int(t.tensor_type),
                                torch.from_numpy(np.array(_fix_rows(spec, raw, cfg))))


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
    """Every tensor of the file (but the rope factors) in the architecture's table, one at a
    time, dequantized to float32; with a tensor-parallel ``plan`` only this rank's slice of each,
    cut from the file's bytes before anything is dequantized. ``blocks``: the quantized tensors
    the kernels read come as their blocks instead, undequantized. A tensor of every expert's
    weights ([experts, out, in]) comes as one tensor per expert."""
    arch = architecture(cfg.architecture)
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        weight = arch.gguf_tensor(t.name)
        if weight is None:
            raise ValueError(f"unknown GGUF tensor {t.name!r}")
        if not rank_holds(weight.spec, plan):
            continue
        if weight.spec.expert:
            if plan is not None:
                raise ValueError("tensor parallelism over experts is not supported yet")
            stacked = np.asarray(t.data)
            for e in range(stacked.shape[0]):
                yield _tensor(t, CheckpointWeight(weight.spec, weight.layer, e), stacked[e], cfg,
                              blocks)
            continue
        yield _tensor(t, weight, _sliced_data(t, weight.spec, plan, cfg), cfg, blocks)


def _tensor(t: Any, weight: CheckpointWeight, data: np.ndarray, cfg: ModelConfig,
            blocks: bool) -> CheckpointTensor:
    """``data`` (the tensor's, or an expert's rows of it) as its blocks, where kept, or
    dequantized."""
    kept = _blocks(t, data, weight.spec, cfg) if blocks else None
    return CheckpointTensor(weight, None if kept is not None else
                            _dequantized(t, data, weight.spec, cfg), kept)
