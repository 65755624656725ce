"""Workload generators (arrivals, lengths, priorities), seeding, and JSONL traces."""

import json
import math

import numpy as np
import pytest

from conveyor.sim.workload import ArrivalProcess, LengthDist, Workload, generate, load_trace


def test_same_seed_same_workload_other_seed_differs():
    a = generate(500, 5.0, seed=3, priorities="0,1")
    b = generate(500, 5.0, seed=3, priorities="0,1")
    c = generate(500, 5.0, seed=4, priorities="0,1")
    for field in ("arrival_s", "prompt_tokens", "output_tokens", "priority"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    assert not np.array_equal(a.prompt_tokens, c.prompt_tokens)


def test_poisson_arrivals_have_the_rate_and_cv_one():
    w = generate(20000, 8.0, input_len="fixed:10", output_len="fixed:10", seed=1)
    gaps = np.diff(w.arrival_s)
    assert w.arrival_s[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_arrivals_have_the_asked_burstiness(cv):
    w = generate(40000, 4.0, "fixed:1", "fixed:1", arrival=f"gamma:{cv}", seed=2)
    gaps = np.diff(w.arrival_s)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_infinite_rate_is_an_offline_batch():
    w = generate(10, math.inf, "fixed:3", "fixed:4")
    assert np.all(w.arrival_s == 0)
    assert np.all(w.prompt_tokens == 3) and np.all(w.output_tokens == 4)


def test_uniform_lengths_cover_both_ends_inclusive():
    x = LengthDist.parse("uniform:100-103").sample(np.random.default_rng(0), 4000)
    assert set(x.tolist()) == {100, 101, 102, 103}


def test_lognormal_mean_and_clipping():
    x = LengthDist.parse("lognormal:mean=200,sigma=0.5").sample(np.random.default_rng(0), 50000)
    assert x.mean() == pytest.approx(200, rel=0.02)
    y = LengthDist.parse("lognormal:mean=200,sigma=2,min=10,max=300").sample(np.random.default_rng(0), 5000)
    assert y.min() == 10 and y.max() == 300


def test_chat_presets_match_the_documented_means():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("chat-input").sample(rng, 100000).mean() == pytest.approx(161, rel=0.05)
    assert LengthDist.parse("chat-output").sample(rng, 100000).mean() == pytest.approx(338, rel=0.05)


def test_weighted_priorities():
    w = generate(20000, 1.0, "fixed:1", "fixed:1", priorities="0:0.25,5:0.75", seed=0)
    assert set(w.priority.tolist()) == {0, 5}
    assert (w.priority == 5).mean() == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize("text", ["fixed:0", "uniform:9-3", "uniform:a-b", "lognormal:mean=5",
                                  "lognormal:mean=5,sigma=1,mode=3", "zipf:1", ""])
def test_bad_length_specs(text):
    with pytest.raises(ValueError, match="bad output length distribution"):
        LengthDist.parse(text, "output length")


@pytest.mark.parametrize("text", ["weibull", "gamma:0", "gamma:x", "poisson:2"])
def test_bad_arrival_specs(text):
    with pytest.raises(ValueError, match="bad arrival process"):
        ArrivalProcess.parse(text)


def test_bad_generate_arguments():
    with pytest.raises(ValueError, match="rate must be > 0"):
        generate(10, 0.0)
    with pytest.raises(ValueError, match="num_requests"):
        generate(0, 1.0)
    with pytest.raises(ValueError, match="bad priorities"):
        generate(10, 1.0, priorities="high")


def test_trace_round_trip(tmp_path):
    w = generate(50, 3.0, priorities="0,1,2", seed=9)
    path = tmp_path / "t.jsonl"
    w.save_jsonl(path)
    back = load_trace(path)
    assert np.allclose(back.arrival_s, w.arrival_s, atol=1e-6)
    for field in ("prompt_tokens", "output_tokens", "priority"):
        assert np.array_equal(getattr(back, field), getattr(w, field))


def test_trace_is_sorted_and_priority_optional(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 2.0, "prompt_tokens": 5, "output_tokens": 6}\n\n'
                    '{"arrival_s": 1, "prompt_tokens": 7, "output_tokens": 8, "priority": 3}\n')
    w = load_trace(path)
    assert w.arrival_s.tolist() == [1.0, 2.0]
    assert w.prompt_tokens.tolist() == [7, 5] and w.priority.tolist() == [3, 0]


@pytest.mark.parametrize("line, match", [
    ("not json", "t.jsonl:2: not valid JSON"),
    ('{"arrival_s": 1, "prompt_tokens": 5}', "t.jsonl:2: missing field output_tokens"),
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 1}', "arrival_s must be a number >= 0"),
    ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 1}', "prompt_tokens must be an integer >= 1"),
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1.5}', "output_tokens must be an integer"),
    ('{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1, "prio": 1}', "unknown field.*prio"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, match):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_empty_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(path)


def test_workload_checks_its_arrays():
    one = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError, match="sorted"):
        Workload(np.array([1.0, 0.5]), one, one, one)
    with pytest.raises(ValueError, match="one entry per request"):
        Workload(np.array([0.0]), one, one, one)
