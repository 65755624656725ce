"""Structured-output masks in the sampler: a packed bitmask row keeps exactly its allowed tokens,
only the constrained rows change, and greedy and seeded sampling pick allowed tokens."""

from __future__ import annotations

import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.model.sampler import Sampler, SampleRow
from conveyor.model.token_bitmask import apply_token_bitmask

VOCAB = 100


def pack(allowed: list[set[int]]) -> torch.Tensor:
    words = -(-VOCAB // 32)
    out = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            word = int(out[r, t // 32]) | (1 << (t % 32))
            out[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def test_every_bit_including_the_sign_bit() -> None:
    allowed = [{0, 31, 32, 63, 99}, set(range(0, VOCAB, 3))]
    logits = torch.zeros(2, VOCAB)
    apply_token_bitmask(logits, pack(allowed), [0, 1])
    for r, tokens in enumerate(allowed):
        assert set(torch.isfinite(logits[r]).nonzero().flatten().tolist()) == tokens


def test_bfloat16_logits_and_repeated_rows() -> None:
    logits = torch.zeros(3, VOCAB, dtype=torch.bfloat16)
    apply_token_bitmask(logits, pack([{7}, {8, 9}]), [1, 1, 0])  # an n > 1 fork's repeats
    assert [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in logits] == [
        {8, 9}, {8, 9}, {7}]


def test_only_constrained_rows_are_masked() -> None:
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    bitmask = pack([{5, 7}, {42}])
    rows = apply_token_bitmask(logits, bitmask, [1, -1, 0, -1])
    assert rows == [0, 2]
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[3], before[3])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == {42}
    assert set(torch.isfinite(logits[2]).nonzero().flatten().tolist()) == {5, 7}


def test_sampler_picks_only_allowed_tokens_greedy_and_sampled() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    allowed = {3, 17, 64}
    rows = [SampleRow(SamplingParams(temperature=t, seed=s), [1], [], 0, 1)
            for t, s in ((0.0, None), (1.0, 5), (1.0, None))]
    unconstrained_choice = Sampler()(logits.clone(), rows[:1]).token_ids[0]
    out = Sampler()(logits.clone(), rows, (pack([allowed]), [0, 0, -1]))
    assert out.token_ids[0] in allowed and out.token_ids[1] in allowed
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert unconstrained_choice == int(logits[0].argmax())
