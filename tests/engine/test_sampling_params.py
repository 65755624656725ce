"""Every invalid SamplingParams field raises ValueError naming that field."""

import pytest

from conveyor.core.sampling_params import SamplingParams

BAD = [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", 101.0),
    ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("seed", 1.5), ("seed", "x"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("logprobs", -1), ("logprobs", 21),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5),
    ("include_stop_str_in_output", 1), ("ignore_eos", "yes"), ("skip_special_tokens", None),
    ("output_kind", 1), ("output_kind", "delta"),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_invalid_field_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_valid_values_and_normalisation():
    p = SamplingParams(n=3, temperature=0, top_k=-1, stop="###", seed=7, logprobs=0, max_tokens=None)
    assert (p.top_k, p.stop, p.greedy) == (0, ["###"], True)
