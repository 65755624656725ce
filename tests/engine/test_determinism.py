"""Deterministic inference end to end (docs/determinism.md): every request's greedy tokens and
logprob bits equal those of the same request run alone, whatever it is batched with, however the
scheduler chunks, caches or preempts it, and with one or two threads; bf16 and float32, each
with float and with integer weight compute (``weight_compute="int8"``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from engine_runs import run_to_end, samples
from long_runs import sized
from torch_threads import torch_threads

MAX_MODEL_LEN = 128
# The executors: a dtype, and "-int8" for integer weight compute.
MODELS = ["bfloat16", "float32", "bfloat16-int8", "float32-int8"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "The quick brown fox jumps over the lazy dog, and then it",
    "Write a haiku about the sea.",
    "List the planets of the solar system in order from the sun: Mercury, Venus,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read books "
    "about dragons and",
    "2 + 2 =",
]


@pytest.fixture(scope="module")
def executors():
    from conveyor.executor.model_executor import ModelExecutor

    return {key: ModelExecutor(dtype=dtype_of(key), weight_compute="int8" if "int8" in key
                               else "float") for key in MODELS}


def dtype_of(key: str) -> str:
    return key.split("-")[0]


@pytest.fixture(scope="module")
def prompts(executors):
    tokenizer = executors["float32"].tokenizer
    return [tokenizer.encode(t) for t in TEXTS]


def run(executor, args: EngineArgs, requests: list[tuple[list[int], SamplingParams]],
        warm_up: list[int] | None = None, preemptions: list[int] | None = None
        ) -> list[list[tuple[list[int], list[float]]]]:
    """Each request's samples as (token ids, chosen-token logprobs), all requests added at once
    (after ``warm_up``, a prompt run first to fill the prefix cache). ``preemptions`` gets the
    engine's count appended."""
    engine = LLMEngine(args, executor=executor)
    if warm_up is not None:
        run_to_end(engine, [(warm_up, SamplingParams(temperature=0, max_tokens=2))], prefix="warm")
    outs = run_to_end(engine, requests)
    if preemptions is not None:
        preemptions.append(engine.get_stats().scheduler.num_preemptions)
    return [samples(out) for out in outs]


_alone: dict[tuple, list[tuple[list[int], list[float]]]] = {}


def alone(executor, dtype: str, prompt: list[int], max_tokens: int):
    """The request by itself: a fresh engine, nothing cached, big blocks, the default policy."""
    key = (dtype, tuple(prompt), max_tokens)
    if key not in _alone:
        args = EngineArgs(dtype=dtype_of(dtype), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=64,
                          max_num_seqs=8, enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0,
                                ignore_eos=True)
        with torch_threads(2):
            _alone[key] = run(executor, args, [(prompt, params)])[0][0]
    return _alone[key]


@st.composite
def scenarios(draw):
    dtype = draw(st.sampled_from(MODELS))
    picks = draw(st.lists(st.integers(0, len(TEXTS) - 1), min_size=1, max_size=6))
    requests = [(i, draw(st.integers(1, 6)), draw(st.sampled_from([1, 1, 2]))) for i in picks]
    policy = draw(st.sampled_from(["prefill_first", "chunked"]))
    block_size = draw(st.sampled_from([4, 8, 16]))
    budget = draw(st.integers(8, 96))
    small_cache = draw(st.booleans())
    return dict(dtype=dtype, requests=requests, policy=policy, block_size=block_size,
                budget=budget, small_cache=small_cache,
                preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
                prefix_caching=draw(st.booleans()),
                warm_up=draw(st.sampled_from([None, 0, 1, 5])),
                threads=draw(st.sampled_from([1, 2])),
                max_num_seqs=draw(st.integers(1, 8)))


@pytest.mark.slow
@settings(max_examples=sized(40, 400), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
def test_every_request_equals_itself_alone(executors, prompts, scenario) -> None:
    s = scenario
    executor = executors[s["dtype"]]
    requests = [(prompts[i], SamplingParams(temperature=0, max_tokens=m, n=n, logprobs=0,
                                            ignore_eos=True))
                for i, m, n in s["requests"]]
    longest = max(len(p) for p, _ in requests)
    # prefill_first admits a prompt whole, and re-prefills prompt + output after a recompute:
    # the budget must hold the longest of those (it caps a sequence's length)
    budget = max(s["budget"], longest + 6) if s["policy"] == "prefill_first" else s["budget"]
    budget = max(budget, s["max_num_seqs"] * 2)  # room for the step's decodes
    needs = [-(-(len(p) + r.max_tokens) // s["block_size"]) * r.n for p, r in requests]
    # small: room for the largest request only, so that the others preempt it or wait
    blocks = max(needs) if s["small_cache"] else sum(needs) + 8
    # prefill_first runs no sequence longer than its step budget
    max_model_len = MAX_MODEL_LEN if s["policy"] == "chunked" else min(MAX_MODEL_LEN, budget)
    args = EngineArgs(dtype=dtype_of(s["dtype"]), max_model_len=max_model_len, block_size=s["block_size"],
                      num_gpu_blocks=blocks, max_num_seqs=s["max_num_seqs"],
                      max_num_batched_tokens=budget, policy=s["policy"],
                      preemption_mode=s["preemption_mode"],
                      enable_prefix_caching=s["prefix_caching"], swap_space=0.05)
    warm = None if s["warm_up"] is None else prompts[s["warm_up"]]
    with torch_threads(s["threads"]):
        got = run(executor, args, requests, warm)
    for (prompt, params), outs in zip(requests, got, strict=True):
        expected = alone(executor, s["dtype"], prompt, params.max_tokens)
        for tokens, logprobs in outs:
            assert tokens == expected[0]
            # bit equality of float32 logprobs (Python floats from them: exact)
            assert logprobs == expected[1]


def test_default_is_deterministic() -> None:
    assert EngineArgs().deterministic


@pytest.mark.parametrize("dtype", MODELS)
def test_batch_of_one_and_of_many_agree(executors, prompts, dtype) -> None:
    """A direct, fast instance of the property: 7 requests together, chunked at 16 tokens, vs
    each alone; the text reads sensibly."""
    executor = executors[dtype]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    args = EngineArgs(dtype=dtype_of(dtype), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=96,
                      max_num_seqs=8, policy="chunked", max_num_batched_tokens=16)
    got = run(executor, args, [(p, params) for p in prompts])
    for prompt, outs in zip(prompts, got, strict=True):
        assert outs[0] == alone(executor, dtype, prompt, 6)
    planets = executor.tokenizer.decode(got[3][0][0])
    assert "Earth" in planets


@pytest.mark.parametrize("key", ["bfloat16", "bfloat16-int8"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_equal_themselves_alone(executors, prompts, mode, key) -> None:
    executor = executors[key]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    chosen = prompts[2:7]
    # room for the largest request alone: the others' growth preempts
    args = EngineArgs(dtype="bfloat16", max_model_len=MAX_MODEL_LEN, block_size=4,
                      num_gpu_blocks=max(-(-(len(p) + 10) // 4) for p in chosen),
                      max_num_seqs=4, preemption_mode=mode, swap_space=0.05)
    preemptions: list[int] = []
    got = run(executor, args, [(p, params) for p in chosen], preemptions=preemptions)
    assert preemptions[0] > 0
    for prompt, outs in zip(chosen, got, strict=True):
        assert outs[0] == alone(executor, key, prompt, 10)


LONG_PROMPT_TOKENS = 3000
LONG_BLOCK = 16
LONG_HIT_BLOCKS = 85  # a cached prefix of 1,360 tokens: an odd number of blocks, no tile multiple


@pytest.fixture(scope="module")
def long_prompt(executors) -> list[int]:
    from conveyor.bench.accuracy import DEFAULT_TEXT

    ids = executors["float32"].tokenizer.encode(DEFAULT_TEXT.read_text())
    assert len(ids) >= LONG_PROMPT_TOKENS
    return ids[:LONG_PROMPT_TOKENS]


@pytest.mark.slow
def test_long_prompt_whole_chunked_and_after_a_prefix_hit(executors, long_prompt) -> None:
    """A 3,000-token prompt computed in one prefill, in 7 chunks, and after a prefix-cache hit
    of 85 blocks: the same tokens and logprob bits (the machine's default dtype, float compute:
    bf16 where the CPU has native bf16, else float32, whose bf16 would be torch's emulation; the
    shorter tests above cover every executor)."""
    import torch

    from conveyor.model.device import dtype_name, resolve_dtype

    key = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    executor = executors[key]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    base = dict(dtype=dtype_of(key), max_model_len=LONG_PROMPT_TOKENS + 8, block_size=LONG_BLOCK,
                num_gpu_blocks=2 * (LONG_PROMPT_TOKENS // LONG_BLOCK + 2), max_num_seqs=2)
    whole = EngineArgs(**base, policy="prefill_first", enable_prefix_caching=False,
                       max_num_batched_tokens=LONG_PROMPT_TOKENS + 8)
    chunk = -(-LONG_PROMPT_TOKENS // 7)
    chunked = EngineArgs(**base, policy="chunked", enable_prefix_caching=False,
                         max_num_batched_tokens=chunk)
    cached = EngineArgs(**base, policy="prefill_first", enable_prefix_caching=True,
                        max_num_batched_tokens=LONG_PROMPT_TOKENS + 8)
    expected = run(executor, whole, [(long_prompt, params)])
    engine = LLMEngine(chunked, executor=executor)
    engine.add_request("chunked", long_prompt, params)
    steps, outs = 0, []
    while engine.has_unfinished_requests():
        steps += 1
        outs += [out for out in engine.step() if out.finished]
    assert steps == 7 + params.max_tokens - 1  # 7 prefill chunks, the first token with the last
    assert samples(outs[0]) == expected[0]
    hit = LONG_HIT_BLOCKS * LONG_BLOCK
    engine = LLMEngine(cached, executor=executor)
    run_to_end(engine, [(long_prompt[:hit], SamplingParams(temperature=0, max_tokens=1))], "warm")
    outs = run_to_end(engine, [(long_prompt, params)])
    assert engine.get_stats().scheduler.prefix_cache_hits == hit
    assert samples(outs[0]) == expected[0]
