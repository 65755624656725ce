"""Sampler: greedy, temperature / top-k / top-p / min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.model.sampler import Sampler, SampleRow, seeded_uniform


def _row(params: SamplingParams, prompt=(), output=(), index=0, position=10) -> SampleRow:
    return SampleRow(params, list(prompt), list(output), index, position)


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_bf16_logits_give_what_their_float32_copy_gives() -> None:
    logits = _logits(8, vocab=300).bfloat16()  # ties are likely in bf16: the first max wins
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1
    plain = [_row(SamplingParams(temperature=0.0))] * 8
    assert Sampler()(logits, plain).token_ids == logits.float().argmax(-1).tolist()
    assert Sampler()(logits, plain).token_ids[3] == 7
    fancy = [_row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.3),
                  prompt=[5, 6])] * 8  # takes the float32 path
    got, want = Sampler()(logits, fancy), Sampler()(logits.float(), fancy)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    out = Sampler(seed=3)(logits, [_row(SamplingParams(temperature=1.0))] * 20000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)

    hot = Sampler(seed=3)(logits, [_row(SamplingParams(temperature=2.0))] * 20000)
    freq = torch.bincount(torch.tensor(hot.token_ids), minlength=5).float() / 20000
    torch.testing.assert_close(freq, (logits[0] / 2).softmax(-1), atol=0.015, rtol=0)


def test_top_k_top_p_min_p_restrict_the_candidates() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7]]).repeat(3000, 1)
    rows = 3000
    sampler = Sampler(seed=1)
    k2 = set(sampler(logits, [_row(SamplingParams(top_k=2))] * rows).token_ids)
    assert k2 == {0, 1}
    probs = logits[0].softmax(-1)
    # top_p just above the top-3 mass keeps exactly four tokens (0, 1, 2, 5).
    p = float(probs.sort(descending=True).values[:3].sum()) + 1e-3
    assert set(sampler(logits, [_row(SamplingParams(top_p=p))] * rows).token_ids) == {0, 1, 2, 5}
    assert set(sampler(logits, [_row(SamplingParams(top_p=0.01))] * rows).token_ids) == {0}
    # min_p: keep tokens with prob >= min_p * max prob.
    ratio = float(probs[2] / probs[0])
    kept = set(sampler(logits, [_row(SamplingParams(min_p=ratio - 1e-3))] * rows).token_ids)
    assert kept == {0, 1, 2}


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(1, vocab=20)
    prompt, output = [1, 2, 3], [4, 5, 5]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    got = Sampler._apply_penalties(logits.clone(), [_row(SamplingParams(repetition_penalty=1.7),
                                                         prompt, output)], 20)
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_penalties_use_output_tokens_only() -> None:
    logits = torch.zeros(1, 8)
    row = _row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[1], output=[2, 3, 3])
    got = Sampler._apply_penalties(logits, [row], 8)[0]
    assert got.tolist() == [0, 0, -0.75, -1.0, 0, 0, 0, 0]
    # A large presence penalty steers greedy decoding off the repeated token.
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[0])])
    assert out.token_ids == [1]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _logits(8, vocab=1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0)(logits[i:i + 1], [_row(seeded, position=i)]).token_ids[0]
             for i in range(8)]
    mixed_rows = [_row(seeded, position=i) if i % 2 == 0 else _row(SamplingParams()) for i in range(8)]
    mixed = Sampler(seed=99)(logits, mixed_rows).token_ids
    assert [mixed[i] for i in range(0, 8, 2)] == alone[0::2]
    all_seeded = Sampler(seed=5)(logits, [_row(seeded, position=i) for i in range(8)]).token_ids
    assert all_seeded == alone
    # Different sample indices give different streams; the hash is deterministic.
    assert seeded_uniform(1234, 0, 10) == seeded_uniform(1234, 0, 10)
    assert len({seeded_uniform(1234, k, 10) for k in range(4)}) == 4


def test_logprobs_hold_sampled_and_top_n() -> None:
    logits = _logits(3, vocab=30)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=3)),
            _row(SamplingParams(temperature=1.0, seed=7, logprobs=0)),
            _row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    ref = logits.log_softmax(-1)
    top3 = ref[0].topk(3).indices.tolist()
    assert list(out.logprobs[0]) == top3  # the greedy token is the top-1
    for t, lp in out.logprobs[0].items():
        assert abs(lp - float(ref[0, t])) < 1e-5
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    assert abs(out.logprobs[1][out.token_ids[1]] - float(ref[1, out.token_ids[1]])) < 1e-5
    assert list(out.logprobs[2]) == [out.token_ids[2]]


def test_stop_tokens_are_masked_until_min_tokens() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 7] = 50.0  # EOS is by far the likeliest token
    logits[:, 4] = 40.0  # then a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    sampler = Sampler(eos_token_ids=[7])
    out = sampler(logits, [_row(params, output=()), _row(params, output=[1]),
                           _row(params, output=[1, 2])])
    assert out.token_ids[0] not in (4, 7) and out.token_ids[1] not in (4, 7)
    assert out.token_ids[2] == 7  # min_tokens reached: stopping is allowed again
