"""`conveyor bench throughput --structured json`: the bench schema keeps every W1 request
generating its full max_tokens (so both runs generate the same tokens), and --profile times the
grammar masks."""

from __future__ import annotations

import pytest

from conveyor.bench.structured import structured_outputs
from conveyor.bench.throughput import _conveyor_generate, format_profile, profile_engine
from conveyor.bench.workloads import make_workload


@pytest.fixture(scope="module")
def llm():
    from conveyor.engine.llm import LLM

    return LLM(num_gpu_blocks=64, block_size=16, max_model_len=512, max_num_seqs=4, seed=0)


def test_structured_w1_requests_run_to_max_tokens_and_mask_time_is_profiled(llm) -> None:
    workload = make_workload("W1", llm.llm_engine.model_config.vocab_size, 0, 3)
    outputs = _conveyor_generate(llm, workload, "json")  # as the bench's warm-up
    for request, out in zip(workload.requests, outputs, strict=True):
        text = out.outputs[0].text
        assert len(out.outputs[0].token_ids) == request.max_tokens
        assert text.startswith('[{"name": "'), text[:40]
    profile = profile_engine(llm.llm_engine, lambda: _conveyor_generate(llm, workload, "json"))
    summary = profile["all_steps"]
    assert summary["mask_ms_per_step"] > 0
    assert "grammar mask" in summary["breakdown_pct"]
    assert "grammar mask" in format_profile(profile)


def test_unknown_structured_kind() -> None:
    assert structured_outputs(None) is None
    with pytest.raises(ValueError, match="one of json"):
        structured_outputs("xml")
