"""Shared fixtures: SmolLM2 (GGUF) in Conveyor and in transformers, both float32, and chat prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from conveyor.model.loader import default_model_path

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning to play the guitar.",
    "What is 17 times 23? Show your work.",
    "Translate 'good morning, my friend' into Spanish.",
    "Write a short Python function that reverses a string.",
    "Why is the sky blue?",
]
NUM_TOKENS = 48


@pytest.fixture(scope="session")
def executor():
    from conveyor.executor.model_executor import ModelExecutor

    # float compute: the checks here are against transformers' float32 forward
    return ModelExecutor(dtype="float32", device="cpu", weight_compute="float")


@pytest.fixture(scope="session")
def prompt_ids(executor) -> list[list[int]]:
    tok = executor.tokenizer
    out = []
    for p in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own GGUF reading (dequantize + un-permute) into its LlamaForCausalLM."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    cfg = load_gguf_checkpoint(path)["config"]
    cfg.pop("_model_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run that every pytest-xdist worker of the run shares."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def reference_tokens(request, prompt_ids, tmp_path_factory) -> list[list[int]]:
    """Greedy NUM_TOKENS tokens per prompt (EOS ignored), one prompt at a time, in transformers.
    Computed once per run: the first worker that needs them writes them for the others."""
    path = _run_folder(tmp_path_factory) / "smollm2_reference_tokens.json"
    with FileLock(f"{path}.lock"):
        if path.exists():
            return json.loads(path.read_text())
        hf_model = request.getfixturevalue("hf_model")
        out = []
        with torch.no_grad():
            for ids in prompt_ids:
                res = hf_model(torch.tensor([ids]), use_cache=True)
                tokens = []
                for _ in range(NUM_TOKENS):
                    nxt = int(res.logits[0, -1].argmax())
                    tokens.append(nxt)
                    res = hf_model(torch.tensor([[nxt]]), past_key_values=res.past_key_values,
                                   use_cache=True)
                out.append(tokens)
        path.write_text(json.dumps(out))
        return out
