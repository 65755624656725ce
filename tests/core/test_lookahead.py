"""Lookahead slots and the n-gram proposer: the token budget counts proposals, a large batch
proposes nothing, rejected slots are given back, and the proposer copies what recurs."""

from __future__ import annotations

import pytest
from core_fakes import FakeExecutor, check_invariants, make_scheduler, step

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.core.spec_decode.ngram import NgramProposer


class Fixed:
    """Proposes ``k`` copies of one token (the fake model rarely agrees)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [5] * k


FIXED = Fixed()


def speculative_scheduler(k: int, budget: int, disable: int = 0, method: str = "ngram", **kw):
    sched = make_scheduler(max_num_batched_tokens=budget, block_size=4, policy="chunked", **kw)
    sched.speculative = SpeculativeConfig(method=method, num_speculative_tokens=k,
                                          disable_by_batch_size=disable)
    return sched


def add(sched, n: int, max_tokens: int = 30) -> None:
    for i in range(n):
        sched.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True))


def test_the_token_budget_counts_lookahead_slots():
    sched = speculative_scheduler(k=4, budget=8, max_num_seqs=2)
    ex = FakeExecutor(sched)
    add(sched, 2)
    step(sched, ex, FIXED)  # prefill, then proposals for the first decodes
    out, _ = step(sched, ex, FIXED)
    assert out.num_decodes == 2 and out.num_new_tokens == [5, 3]  # 1 + 4, then 1 + 2 of 8
    assert out.num_batched_tokens == 8 and out.num_spec_tokens == 6
    check_invariants(sched)


def test_a_large_batch_proposes_nothing():
    sched = speculative_scheduler(k=4, budget=64, disable=2, max_num_seqs=3)
    ex = FakeExecutor(sched)
    add(sched, 3)
    step(sched, ex, FIXED)
    out, _ = step(sched, ex, FIXED)
    assert out.num_new_tokens == [1, 1, 1] and out.num_spec_tokens == 0


def test_rejected_slots_are_given_back():
    sched = speculative_scheduler(k=8, budget=64, max_num_seqs=1, num_gpu_blocks=8)
    ex = FakeExecutor(sched)
    add(sched, 1)
    step(sched, ex, FIXED)
    seq = sched.running[0]
    out, _ = step(sched, ex, FIXED)
    assert out.num_new_tokens == [9]
    # the step held blocks for 3 + 8 + 1 positions; what is left covers the tokens only
    assert len(seq.block_tables[0]) == -(-len(seq.token_ids) // 4) < 3
    assert sched.block_manager.num_free_blocks == 8 - len(seq.block_tables[0])
    check_invariants(sched)


def test_a_decode_without_a_proposal_verifies_nothing():
    sched = speculative_scheduler(k=4, budget=64, max_num_seqs=1)
    ex = FakeExecutor(sched)
    add(sched, 1)
    step(sched, ex)  # no proposer: nothing proposed after the prefill
    out, _ = step(sched, ex, FIXED)
    assert out.num_new_tokens == [1] and out.num_spec_tokens == 0
    out, _ = step(sched, ex, FIXED)  # the proposal made after the last step
    assert out.num_new_tokens == [5]


def test_a_draft_model_gets_slots_for_its_next_proposal():
    """Past the tokens it verifies, a decode holds k more slots (which the token budget does
    not count): the draft model writes its next proposal's K/V there after the step."""
    sched = speculative_scheduler(k=4, budget=64, max_num_seqs=1, num_gpu_blocks=12,
                                  method="draft_model")
    ex = FakeExecutor(sched)
    add(sched, 1)
    step(sched, ex, FIXED)  # prefill: 3 tokens, then the first sampled one
    seq = sched.running[0]
    out = sched.schedule()
    assert out.num_new_tokens == [5] and out.num_batched_tokens == 5
    assert len(seq.block_tables[0]) * 4 >= len(seq.token_ids) + 4 + 4
    sched.update(out, ex.execute(out))
    assert len(seq.block_tables[0]) == -(-len(seq.token_ids) // 4)  # rejected and drafting slots
    check_invariants(sched)


@pytest.mark.parametrize(("tokens", "k", "want"), [
    ([1, 2, 3, 9, 1, 2, 3], 4, [9, 1, 2, 3]),  # continues the earlier occurrence
    ([1, 2, 7, 3, 1, 2, 8, 3, 1, 2], 2, [8, 3]),  # the latest occurrence wins
    ([4, 2, 5, 6, 3, 2, 5, 9, 2, 5], 1, [9]),  # the longest n-gram first: [2, 5] -> 9
    ([5, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # a short period repeats past the end
    ([1, 2, 3], 3, []),  # nothing recurs
])
def test_ngram_proposals(tokens, k, want):
    assert NgramProposer(1, 3).lookup(tokens, k) == want


def test_ngram_min_length():
    assert NgramProposer(2, 3).lookup([7, 1, 8, 1], 2) == []  # only a unigram recurs
    assert NgramProposer(1, 3).lookup([7, 1, 8, 1], 2) == [8, 1]


def test_speculative_config_errors():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")

