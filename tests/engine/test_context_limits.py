"""The context length the engine advertises is one its policy can run: a request asking for
``max_tokens`` that fit in it gets all of them, however the scheduler preempts it."""

from __future__ import annotations

import copy

import pytest

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm_engine import LLMEngine

PROMPT = "The three most important inventions in history are"


def _engine(shared, **changes) -> LLMEngine:
    args = shared.engine_args.replace(**{"max_model_len": None, **changes})
    return LLMEngine(args, executor=copy.copy(shared.executor))


def _finish(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict:
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_prefill_first_context_is_its_step_budget(engine) -> None:
    small = _engine(engine, policy="prefill_first", max_num_batched_tokens=64)
    assert small.max_model_len == 64
    assert _engine(engine, policy="chunked", max_num_batched_tokens=64).max_model_len > 64
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        LLMEngine(engine.engine_args.replace(policy="prefill_first", max_num_batched_tokens=64,
                                             max_model_len=128),
                  executor=copy.copy(engine.executor))


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_max_tokens_up_to_the_context_are_all_generated_under_preemption(engine, policy) -> None:
    """Four requests each filling the whole advertised context, in a cache that holds about
    two: every one is preempted and recomputed, and each still ends with all its tokens."""
    budget = 64
    probe = _engine(engine, policy=policy, max_num_batched_tokens=budget)
    context = min(probe.max_model_len, 96)
    prompt_len = len(probe.tokenizer.encode(PROMPT))
    max_tokens = context - prompt_len
    blocks = 2 * -(-context // 4)
    small = _engine(engine, policy=policy, max_num_batched_tokens=budget, num_gpu_blocks=blocks,
                    block_size=4, max_num_seqs=4, max_model_len=context)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    finals = _finish(small, {f"r{i}": params for i in range(4)})
    assert small.get_stats().scheduler.num_preemptions > 0
    for out in finals.values():
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.outputs[0].finish_reason == "length"
    stats = small.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
