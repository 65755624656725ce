"""Gemma 3 270M through ``TritonBackend`` (in Triton's interpreter without a GPU): the greedy
tokens of a short prompt equal transformers' float32 ones (``gemma3_data``, which
``model/test_gemma3.py`` checks against transformers itself). Head size 256, one KV head, q/k
norms and the sliding layers' window go through the Triton kernels."""

from __future__ import annotations

import pytest

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model.loader import GEMMA3_ALIAS
from engine_runs import run_to_end
from gemma3_data import SHORT_PROMPT, SHORT_PROMPT_TOKENS, gemma3_path


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(monkeypatch, device) -> None:
    gemma3_path()
    monkeypatch.setenv("CONVEYOR_BACKEND", "triton")
    eng = LLMEngine(EngineArgs(model=GEMMA3_ALIAS, dtype="float32", device=device.type,
                               enforce_eager=True))
    assert eng.executor.model.backend.name == "triton"
    params = SamplingParams(max_tokens=len(SHORT_PROMPT_TOKENS), temperature=0, ignore_eos=True)
    out = run_to_end(eng, [(SHORT_PROMPT, params)])[0]
    assert list(out.outputs[0].token_ids) == SHORT_PROMPT_TOKENS
