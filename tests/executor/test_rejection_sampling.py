"""Rejection sampling keeps the target distribution (chi-square tests on a tiny random Llama's
logits), for one-hot proposals (n-gram) and for proposals drawn from a draft distribution."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.executor.spec_verify import rejection_sample
from conveyor.model.sampler import Sampler, SampleRow

VOCAB = 24
TRIALS = 6000


@pytest.fixture(scope="module")
def target_logits() -> torch.Tensor:
    """A tiny random Llama's logits after a 6-token context and two more tokens: [3, VOCAB]."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        ids = torch.tensor([[3, 7, 1, 9, 4, 11, 5, 6]])
        return model(ids).logits[0, -3:].float()


def chi_square_ok(counts: list[int], probs: torch.Tensor) -> bool:
    """Pearson's test at p = 0.001 (bins with under 5 expected merged; Wilson-Hilferty quantile)."""
    total = sum(counts)
    expected = (probs / probs.sum() * total).tolist()
    bins, obs, exp = [], 0, 0.0
    for c, e in sorted(zip(counts, expected, strict=True), key=lambda ce: ce[1]):
        obs, exp = obs + c, exp + e
        if exp >= 5:
            bins.append((obs, exp))
            obs, exp = 0, 0.0
    if exp and bins:
        bins[-1] = (bins[-1][0] + obs, bins[-1][1] + exp)
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def rows(params: SamplingParams, n: int) -> list[SampleRow]:
    return [SampleRow(params, [3, 7, 1, 9, 4, 11], [], 0, 6 + j) for j in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=12)])
def test_one_hot_proposals_keep_the_target_distribution(target_logits, params):
    sampler = Sampler(seed=1)
    r = rows(params, 3)
    probs = sampler.probs(target_logits, r)
    # what an n-gram proposer might copy: likely tokens, but not the likeliest
    drafts = [int(probs[0].argsort(descending=True)[1]), int(probs[1].argsort(descending=True)[2])]
    first = [0] * VOCAB
    second = [0] * VOCAB  # the token after an accepted first draft
    naive = [0] * VOCAB  # control: a sampler that takes the draft without the accept test
    for _ in range(TRIALS):
        tokens = rejection_sample(probs, drafts, r, sampler.generator)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
        naive[drafts[0] if torch.rand((), generator=sampler.generator) < 0.5 else tokens[0]] += 1
    assert chi_square_ok(first, probs[0])
    assert sum(second) > 50 and chi_square_ok(second, probs[1])
    assert not chi_square_ok(naive, probs[0])  # the test tells a wrong sampler apart


def test_draft_distribution_proposals_keep_the_target_distribution(target_logits):
    sampler = Sampler(seed=2)
    r = rows(SamplingParams(temperature=1.0), 2)
    probs = sampler.probs(target_logits[:2], r)
    q = torch.softmax(torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    first = [0] * VOCAB
    for _ in range(TRIALS):
        draft = int(torch.multinomial(q[0], 1, generator=sampler.generator))
        tokens = rejection_sample(probs, [draft], r, sampler.generator, draft_probs=q)
        first[tokens[0]] += 1
    assert chi_square_ok(first, probs[0])
    assert not chi_square_ok(first, q[0])


def test_greedy_rows_reject_at_the_first_disagreement(target_logits):
    """A greedy row's distribution is one-hot at its argmax: the draft is kept iff it is the
    argmax, and a rejected draft is replaced by the argmax."""
    from conveyor.executor.spec_verify import _accept_greedy

    best = target_logits.argmax(-1).tolist()
    assert _accept_greedy([best[0], best[1]], best) == best
    wrong = (best[1] + 1) % VOCAB
    assert _accept_greedy([best[0], wrong], best) == best[:2]
