"""Speculative decoding on the real SmolLM2 model: n-gram proposals verified in one forward give
token for token the output of plain greedy decoding (deterministic inference), with preemption
(recompute and swap), prefix-cache hits and both policies; every KV block comes back."""

from __future__ import annotations

import pytest
from speculative_runs import run_greedy

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine

TEXTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints:\n",
    "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
    "Now list them again:",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read",
    "Copy the list: apples, pears, plums, cherries, grapes, lemons.",
    "The capital of France is",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
MAX_TOKENS = 48
BASE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, block_size=16)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def executor(request):
    from conveyor.executor.model_executor import ModelExecutor

    return ModelExecutor(dtype=request.param)


@pytest.fixture(scope="module")
def prompts(executor):
    return [executor.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(executor, prompts):
    tokens, _ = run_greedy(executor, EngineArgs(**BASE, num_gpu_blocks=200), prompts, MAX_TOKENS)
    return tokens


@pytest.mark.parametrize(("policy", "mode", "blocks", "warm_up"), [
    ("prefill_first", "recompute", 200, False),
    ("chunked", "recompute", 200, True),
    ("chunked", "recompute", 24, False),  # preemption
    ("prefill_first", "swap", 24, True),  # preemption by swap, prefix hits
])
def test_ngram_greedy_equals_plain_greedy(executor, prompts, plain, policy, mode, blocks, warm_up):
    args = EngineArgs(**BASE, num_gpu_blocks=blocks, policy=policy, preemption_mode=mode,
                      speculative_method="ngram", num_speculative_tokens=4,
                      speculative_disable_by_batch_size=0,
                      long_prefill_token_threshold=48 if policy == "chunked" else 0)
    tokens, stats = run_greedy(executor, args, prompts, MAX_TOKENS, warm_up=warm_up)
    for i, (got, want) in enumerate(zip(tokens, plain, strict=True)):
        assert got == want, f"prompt {i}: speculative output differs from plain greedy"
    assert stats.scheduler.spec_accepted_tokens > 0 and stats.scheduler.spec_draft_tokens > stats.scheduler.spec_accepted_tokens
    if blocks < 100:
        assert stats.scheduler.num_preemptions > 0
    if warm_up:
        assert stats.scheduler.prefix_cache_hits > 0


def test_seeded_sampling_with_proposals_is_reproducible(executor, prompts):
    """Temperature > 0 goes through rejection sampling; a seeded request gives the same tokens
    run alone or batched, and proposals are both accepted and rejected."""
    args = EngineArgs(**BASE, num_gpu_blocks=200, speculative_method="ngram",
                      speculative_disable_by_batch_size=0)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)
    results = []
    for batch in (prompts[:1], prompts):
        engine = LLMEngine(args, executor=executor)
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        stats = engine.get_stats()
        assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
        results.append(done["0"])
    assert results[0] == results[1] and len(results[0]) == 32
    assert 0 < stats.scheduler.spec_accepted_tokens < stats.scheduler.spec_draft_tokens
