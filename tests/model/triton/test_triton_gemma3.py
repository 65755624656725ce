"""Gemma 3 270M through ``TritonBackend`` (in Triton's interpreter without a GPU): the greedy
tokens of a short prompt equal transformers' float32 ones (``gemma3_data``, which
``model/test_gemma3.py`` checks against transformers itself). Head size 256, one KV head, q/k
norms and the sliding layers' window go through the Triton kernels. A tiny random Gemma 3 on
three KV-cache groups: its tokens equal transformers' through chunks and decodes past the window
(each group's block tables, with null entries before the window)."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model.loader import GEMMA3_ALIAS
from engine_runs import run_to_end
from gemma3_data import SHORT_PROMPT, SHORT_PROMPT_TOKENS, gemma3_path
from tiny_models import save_hybrid_gemma3


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(monkeypatch, device) -> None:
    gemma3_path()
    monkeypatch.setenv("CONVEYOR_BACKEND", "triton")
    eng = LLMEngine(EngineArgs(model=GEMMA3_ALIAS, dtype="float32", device=device.type,
                               enforce_eager=True))
    assert eng.executor.model.backend.name == "triton"
    assert len(eng.scheduler.cache_config.kv_cache_groups) == 6
    params = SamplingParams(max_tokens=len(SHORT_PROMPT_TOKENS), temperature=0, ignore_eos=True)
    out = run_to_end(eng, [(SHORT_PROMPT, params)])[0]
    assert list(out.outputs[0].token_ids) == SHORT_PROMPT_TOKENS


def test_tiny_hybrid_model_equals_transformers(monkeypatch, device, tmp_path) -> None:
    """Window 8, blocks of 4: a 13-token prompt in chunks of 5, then 7 decodes."""
    ref = save_hybrid_gemma3(str(tmp_path), sliding_window=8)
    prompt = [5, 9, 11, 40, 41, 7, 3, 77, 12, 60, 33, 8, 19]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=7, min_new_tokens=7,
                            do_sample=False)[0, len(prompt):].tolist()
    monkeypatch.setenv("CONVEYOR_BACKEND", "triton")
    eng = LLMEngine(EngineArgs(model=str(tmp_path), dtype="float32", device=device.type,
                               enforce_eager=True, block_size=4, num_gpu_blocks=64,
                               max_model_len=64, max_num_seqs=2, policy="chunked",
                               max_num_batched_tokens=5))
    assert eng.executor.model.backend.name == "triton"
    assert len(eng.scheduler.cache_config.kv_cache_groups) == 3
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    out = run_to_end(eng, [({"prompt_token_ids": prompt}, params)])[0]
    assert list(out.outputs[0].token_ids) == want
