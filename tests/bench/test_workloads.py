"""The named workloads are deterministic and match their specifications."""

import pytest

from conveyor.bench.workloads import (
    FIRST_TOKEN_ID,
    SPECS,
    is_single_stream,
    make_workload,
    warmup_workload,
)

VOCAB = 49152


@pytest.mark.parametrize("name", sorted(SPECS))
def test_same_seed_same_requests_other_seed_other_prompts(name):
    a, b = make_workload(name, VOCAB, seed=0), make_workload(name, VOCAB, seed=0)
    assert a == b
    c = make_workload(name, VOCAB, seed=1)
    assert [r.prompt_token_ids for r in c.requests] != [r.prompt_token_ids for r in a.requests]


def test_w1_shape():
    w = make_workload("W1", VOCAB)
    assert len(w.requests) == 64
    lengths = [len(r.prompt_token_ids) for r in w.requests]
    assert min(lengths) >= 32 and max(lengths) <= 256
    assert len(set(lengths)) > 30  # spread over the range, not one length
    assert all(r.max_tokens == 128 for r in w.requests)
    assert w.num_output_tokens == 64 * 128
    assert w.num_prompt_tokens == sum(lengths)


def test_w2_shares_a_512_token_prefix_then_32_to_64_own_tokens():
    w = make_workload("W2", VOCAB)
    assert len(w.requests) == 64 and w.shared_prefix_len == 512
    prefix = w.requests[0].prompt_token_ids[:512]
    for r in w.requests:
        assert r.prompt_token_ids[:512] == prefix
        assert 32 <= len(r.prompt_token_ids) - 512 <= 64
        assert r.max_tokens == 64
    tails = {tuple(r.prompt_token_ids[512:]) for r in w.requests}
    assert len(tails) == 64


def test_w3_long_prompts_and_s1_single_stream():
    w3 = make_workload("W3", VOCAB)
    assert len(w3.requests) == 16
    assert all(1500 <= len(r.prompt_token_ids) <= 2000 and r.max_tokens == 64
               for r in w3.requests)
    s1 = make_workload("S1", VOCAB)
    assert len(s1.requests) == 1
    assert len(s1.requests[0].prompt_token_ids) == 128 and s1.requests[0].max_tokens == 256


def test_c1_prompt_restarts_its_own_beginning():
    w = make_workload("C1", 49152, seed=3)
    assert is_single_stream("C1") and is_single_stream("S1") and not is_single_stream("W1")
    (req,) = w.requests
    assert len(req.prompt_token_ids) == 384 and req.max_tokens == 256
    assert req.prompt_token_ids[-32:] == req.prompt_token_ids[:32]


def test_token_ids_stay_in_the_ordinary_vocabulary():
    small = 1000
    w = make_workload("W1", small)
    ids = [t for r in w.requests for t in r.prompt_token_ids]
    assert min(ids) >= FIRST_TOKEN_ID and max(ids) < small


def test_num_requests_override_keeps_the_first_requests():
    full, four = make_workload("W1", VOCAB), make_workload("W1", VOCAB, num_requests=4)
    assert four.requests == full.requests[:4]


def test_warmup_is_short():
    w = warmup_workload(make_workload("W1", VOCAB))
    assert len(w.requests) == 2 and all(r.max_tokens == 4 for r in w.requests)


@pytest.mark.parametrize("kwargs, field", [
    ({"name": "W9", "vocab_size": VOCAB}, "workload"),
    ({"name": "W1", "vocab_size": 10}, "vocab_size"),
    ({"name": "W1", "vocab_size": VOCAB, "num_requests": 0}, "num_requests"),
])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_workload(**kwargs)
