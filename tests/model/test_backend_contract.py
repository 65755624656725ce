"""The ``Backend`` contract (``model/backends/base.py``) declares every operation the model
runner and the models call on a backend, so that any backend a device selects serves every
path: CUDA graphs capture decode steps only through a backend that builds their metadata from
device tensors (``captures_decode``), and a runner over another backend runs them eagerly."""

from __future__ import annotations

import dataclasses
import inspect
import re

import torch

import conveyor.executor.model_runner as model_runner
import conveyor.model.gemma3 as gemma3
import conveyor.model.llama as llama
from conveyor.executor.model_runner import ModelRunner
from conveyor.model.backends.base import Backend
from conveyor.model.backends.cpu_kernels import CpuBackend
from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.backends.triton_kernels import TritonBackend
from conveyor.model.loader import load_model
from tiny_models import save_tiny_causal_lm

CALL = re.compile(r"\bbackend\.(\w+)")


def test_every_backend_call_is_declared() -> None:
    called = {name for module in (model_runner, llama, gemma3)
              for name in CALL.findall(inspect.getsource(module))}
    assert {"build_metadata", "decode_metadata", "attention", "plan_decode"} <= called
    undeclared = sorted(name for name in called if not hasattr(Backend, name))
    assert not undeclared, f"called on a backend but not declared by Backend: {undeclared}"


def test_cuda_graphs_only_over_a_backend_that_captures_decodes(tmp_path) -> None:
    save_tiny_causal_lm("llama_tied", str(tmp_path))
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), "float",
                        with_tokenizer=False)
    cuda = torch.device("cuda")  # a device object only: nothing runs on it here
    for backend, graphs in ((TorchBackend(cuda), False), (CpuBackend(cuda, False), False),
                            (TritonBackend(torch.device("cpu")), True)):
        plan = dataclasses.replace(loaded.kernels, backend=backend)
        runner = ModelRunner(dataclasses.replace(loaded, kernels=plan), cuda, cuda_graphs=True)
        assert runner.use_cuda_graphs == graphs, backend.name
        assert backend.captures_decode == graphs
    try:
        TorchBackend(cuda).decode_metadata(*[torch.zeros(1, dtype=torch.int64)] * 4)
    except NotImplementedError as e:
        assert "captures_decode is False" in str(e)
    else:
        raise AssertionError("the torch backend built decode metadata for a graph")
