"""prompt_logprobs on SmolLM2 equal transformers' log-softmax over the same prompt, whether the
prompt is computed in one step or in chunks, and after a prefix-cache-warm twin."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine

TOP_N = 5


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_prompt_logprobs_match_transformers(executor, hf_model, prompt_ids, policy) -> None:
    args = EngineArgs(dtype="float32", policy=policy, max_num_batched_tokens=64 if policy ==
                      "prefill_first" else 16, max_model_len=64, num_gpu_blocks=64,
                      block_size=16, max_num_seqs=8)
    engine = LLMEngine(args, executor=executor)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_N)
    prompts = prompt_ids[:3]
    for i, ids in enumerate(prompts):
        # the twin warms the prefix cache; the scored request must still compute every position
        engine.add_request(f"twin{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for i, ids in enumerate(prompts):
        got = finals[f"r{i}"].prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None
        ref = _reference(hf_model, ids)
        for pos in range(1, len(ids)):
            row = ref[pos - 1]
            entry = got[pos]
            actual = entry[ids[pos]]
            assert abs(actual.logprob - row[ids[pos]].item()) < 1e-3, (i, pos)
            assert actual.rank == int((row > row[ids[pos]]).sum()) + 1
            top = row.topk(TOP_N)
            for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[t].logprob - lp) < 1e-3
        assert finals[f"twin{i}"].prompt_logprobs is None
    stats = engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
