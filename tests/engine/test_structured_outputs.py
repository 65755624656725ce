"""Structured outputs end to end on the real SmolLM2: JSON schemas, regex, choice and grammar
constraints hold under greedy and seeded sampling, n > 1, stop strings, logprobs, preemption by
recompute and swap, and the prefix cache; a grammar that fails to compile finishes only its own
request."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.structured_outputs_params import StructuredOutputsParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.chat import chat_prompt
from conveyor.engine.llm_engine import LLMEngine
from engine_runs import run_to_end

CASES = json.loads((Path(__file__).parents[1] / "structured_outputs" / "schemas.json")
                   .read_text())["cases"]
PROMPTS = [c["prompt"] for c in CASES]
SCHEMAS = [c["schema"] for c in CASES]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def executor():
    from conveyor.executor.model_executor import ModelExecutor

    return ModelExecutor(dtype="float32")


@pytest.fixture(scope="module")
def chat_prompts(executor):
    return [chat_prompt(executor.tokenizer, [{"role": "user", "content": p}])["prompt_token_ids"]
            for p in PROMPTS]


def run(executor, requests, **engine_kwargs):
    """Each request's finished RequestOutput, all added at once; plus the engine."""
    args = EngineArgs(dtype="float32", max_model_len=512, block_size=16,
                      num_gpu_blocks=engine_kwargs.pop("num_gpu_blocks", 256), max_num_seqs=16,
                      **engine_kwargs)
    engine = LLMEngine(args, executor=executor)
    outs = run_to_end(engine, requests)
    stats = engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
    return outs, engine


def constrained(temperature=0.0, max_tokens=120, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def assert_valid(schema, text: str) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_a_dozen_schemas_in_one_batch_all_validate(executor, chat_prompts) -> None:
    outs, _ = run(executor, [(p, constrained(json=s)) for p, s in zip(chat_prompts, SCHEMAS,
                                                                        strict=True)])
    for schema, out in zip(SCHEMAS, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert_valid(schema, c.text)


def test_json_object_regex_choice_and_grammar(executor, chat_prompts) -> None:
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    choices = ["Paris", "London", "Rome"]
    requests = [(chat_prompts[1], constrained(json_object=True)),
                (chat_prompts[0], constrained(regex=regex)),
                (chat_prompts[2], constrained(choice=choices)),
                (chat_prompts[5], constrained(grammar='root ::= "yes" | "no" | "maybe " [0-9]'))]
    obj, rx, choice, grammar = (o.outputs[0] for o in run(executor, requests)[0])
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(regex, rx.text), rx.text
    assert choice.text in choices
    assert re.fullmatch(r"yes|no|maybe [0-9]", grammar.text), grammar.text
    assert all(c.finish_reason == "stop" for c in (obj, rx, choice, grammar))


def test_sampling_with_n_samples_each_sample_validates(executor, chat_prompts) -> None:
    schema = SCHEMAS[8]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=schema))
    (out,), _ = run(executor, [(chat_prompts[8], params)])
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # the samples differ, each is valid
    for text in texts:
        assert_valid(schema, text)


def test_stop_string_cuts_a_constrained_output(executor, chat_prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=['"colour"'],
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[1]))
    (out,), _ = run(executor, [(chat_prompts[1], params)])
    c = out.outputs[0]
    assert c.text == "{" and c.finish_reason == "stop" and c.stop_reason == '"colour"'


def test_logprobs_are_those_of_the_masked_distribution(executor, chat_prompts) -> None:
    choices = ["Paris", "London"]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    (out,), _ = run(executor, [(chat_prompts[2], params)])
    c = out.outputs[0]
    assert c.text in choices
    tokenizer = executor.tokenizer
    first = c.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > -math.inf}
    # only prefixes of the choices are possible, and they carry all the probability mass
    assert all(any(ch.startswith(tokenizer.decode([t])) for ch in choices) for t in finite)
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-4)


def test_grammar_end_finishes_even_under_ignore_eos(executor, chat_prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,), _ = run(executor, [(chat_prompts[5], params)])
    c = out.outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    assert len(c.token_ids) <= 3  # the choice, then the grammar's end


@pytest.fixture(scope="module")
def six_requests_alone(executor, chat_prompts):
    requests = [(p, constrained(json=s, max_tokens=40))
                for p, s in zip(chat_prompts[:6], SCHEMAS[:6], strict=True)]
    return requests, [run(executor, [r])[0][0].outputs[0] for r in requests]


@pytest.mark.parametrize(("mode", "policy"), [("recompute", "prefill_first"),
                                              ("swap", "prefill_first"),
                                              ("recompute", "chunked")])
def test_preempted_constrained_requests_equal_themselves_alone(executor, six_requests_alone,
                                                               mode, policy) -> None:
    requests, alone = six_requests_alone
    # room for two or three requests: the others' growth preempts; chunked: prompts in pieces
    outs, engine = run(executor, requests, num_gpu_blocks=8, preemption_mode=mode,
                       swap_space=0.05, policy=policy, max_num_batched_tokens=32 if policy ==
                       "chunked" else 2048)
    assert engine.get_stats().scheduler.num_preemptions > 0
    for a, out in zip(alone, outs, strict=True):
        assert list(out.outputs[0].token_ids) == list(a.token_ids)
        assert out.outputs[0].text == a.text


def test_prefix_cache_hits_do_not_change_constrained_outputs(executor, chat_prompts) -> None:
    requests = [(chat_prompts[4], constrained(json=SCHEMAS[4]))] * 3
    plain, _ = run(executor, requests[:1])
    cached, engine = run(executor, requests, enable_prefix_caching=True)
    assert engine.get_stats().scheduler.prefix_cache_hits > 0
    for out in cached:
        assert out.outputs[0].text == plain[0].outputs[0].text
        assert_valid(SCHEMAS[4], out.outputs[0].text)


def test_a_grammar_that_fails_to_compile_finishes_only_its_request(executor,
                                                                   chat_prompts) -> None:
    good = [(p, constrained(json=s)) for p, s in zip(chat_prompts[:3], SCHEMAS[:3], strict=True)]
    plain = (chat_prompts[3], SamplingParams(temperature=0.0, max_tokens=12))
    bad = (chat_prompts[4], constrained(grammar="root ::= ("))
    alone = [run(executor, [r])[0][0].outputs[0].text for r in [*good, plain]]
    outs, _ = run(executor, [good[0], bad, good[1], plain, good[2]])
    failed = outs[1]
    assert failed.outputs[0].finish_reason == "abort"
    assert "structured_outputs.grammar cannot be compiled" in failed.finish_message
    assert "EBNF parser error" in failed.finish_message
    assert [o.outputs[0].text for o in (outs[0], outs[2], outs[3], outs[4])] == [
        alone[0], alone[1], alone[3], alone[2]]


def test_constrained_requests_are_not_speculated_beside_speculating_ones(executor,
                                                                         chat_prompts) -> None:
    """Their masks hold for the next token only: under --speculative-method ngram they decode a
    token a step, with the same output, while an unconstrained request beside them speculates."""
    repetitive = executor.tokenizer.encode("one two three one two three one two three one two")
    requests = [(chat_prompts[8], constrained(json=SCHEMAS[8])),
                (repetitive, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    plain, _ = run(executor, requests)
    spec, engine = run(executor, requests, speculative_method="ngram",
                       speculative_disable_by_batch_size=0)
    assert spec[0].outputs[0].text == plain[0].outputs[0].text
    assert_valid(SCHEMAS[8], spec[0].outputs[0].text)
    assert engine.get_stats().scheduler.spec_draft_tokens > 0  # the other request did speculate
