"""LLMEngine end to end on the real SmolLM2: termination rules, n>1, logprobs, abort, bad input.

Requests that do not depend on each other run in one batch to keep the number of steps small.
"""

import pytest

from conveyor.core.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The three most important inventions in history are"
BASE_TOKENS = 16


def run(engine, requests):
    """Add ``{request_id: (prompt, params)}``, step to the end; final outputs and every output seen."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert set(finals) == set(requests)
    return finals, seen


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def base(llm):
    """Greedy PROMPT for BASE_TOKENS tokens (EOS ignored): the reference the stop tests cut."""
    finals, seen = run(llm.llm_engine, {"base": (PROMPT, greedy(max_tokens=BASE_TOKENS, ignore_eos=True,
                                                               stop=["zzzz"]))})
    return finals["base"], seen


def test_max_tokens_text_and_metrics(engine, tokenizer, base):
    out = base[0]
    c = out.outputs[0]
    assert (len(c.token_ids), c.finish_reason, c.stop_reason) == (BASE_TOKENS, "length", None)
    assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert out.prompt == PROMPT and out.prompt_token_ids == tokenizer.encode(PROMPT)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_streamed_outputs_are_cumulative(base):
    seen = base[1]
    texts = [o.outputs[0].text for o in seen]
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, BASE_TOKENS + 1))
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert [o.finished for o in seen] == [False] * (BASE_TOKENS - 1) + [True]


def test_delta_outputs_add_up_to_the_cumulative_ones_and_final_only_is_the_last(
        engine, tokenizer, base):
    """The same greedy request three ways, cut by a stop string that crosses a token boundary
    (its first characters are held back, then dropped), n=2 and logprobs on."""
    stop = _boundary_crossing_stop(tokenizer, base[0].outputs[0].token_ids)
    params = {kind: greedy(max_tokens=BASE_TOKENS, ignore_eos=True, stop=[stop], n=2, logprobs=2,
                           output_kind=kind) for kind in RequestOutputKind}
    finals, seen = run(engine, {kind.name: (PROMPT, p) for kind, p in params.items()})
    by_kind = {kind.name: [o for o in seen if o.request_id == kind.name] for kind in RequestOutputKind}
    assert len(by_kind["DELTA"]) == len(by_kind["CUMULATIVE"]) > 2
    assert by_kind["FINAL_ONLY"] == [finals["FINAL_ONLY"]]
    full = finals["CUMULATIVE"].outputs
    assert full[0].finish_reason == "stop" and not full[0].text.endswith(stop)
    for i, whole in enumerate(full):
        deltas = [o.outputs[i] for o in by_kind["DELTA"]]
        assert "".join(d.text for d in deltas) == whole.text
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert [lp for d in deltas for lp in d.logprobs] == whole.logprobs
        assert deltas[-1].cumulative_logprob == whole.cumulative_logprob
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
        only = finals["FINAL_ONLY"].outputs[i]
        assert (only.text, only.token_ids, only.logprobs) == (whole.text, whole.token_ids,
                                                              whole.logprobs)


def _boundary_crossing_stop(tokenizer, token_ids):
    """A 5-character piece of the output that starts in one token and ends in a later one."""
    text = tokenizer.decode(token_ids)
    for i in range(3, len(token_ids)):
        b = len(tokenizer.decode(token_ids[:i]))  # a token boundary in the text
        piece = text[b - 2 : b + 3]
        if len(text) > b + 3 and piece.strip() == piece:
            return piece
    raise AssertionError("no suitable stop string in " + text)


def test_stop_strings_and_stop_token_ids(engine, tokenizer, base):
    ref = base[0].outputs[0]
    stop = _boundary_crossing_stop(tokenizer, ref.token_ids)
    index = ref.text.find(stop)
    stop_token = ref.token_ids[5]
    first = ref.token_ids.index(stop_token)
    finals, _ = run(engine, {
        "cut": (PROMPT, greedy(max_tokens=BASE_TOKENS, ignore_eos=True, stop=[stop])),
        "kept": (PROMPT, greedy(max_tokens=BASE_TOKENS, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=True)),
        "token": (PROMPT, greedy(max_tokens=BASE_TOKENS, ignore_eos=True, stop_token_ids=[stop_token])),
    })
    cut = finals["cut"].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (ref.text[:index], "stop", stop)
    assert cut.token_ids == ref.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < BASE_TOKENS
    assert finals["kept"].outputs[0].text == ref.text[: index + len(stop)]
    tok = finals["token"].outputs[0]
    assert tok.token_ids == ref.token_ids[: first + 1]
    assert (tok.finish_reason, tok.stop_reason) == ("stop", stop_token)
    assert tok.text == tokenizer.decode(ref.token_ids[:first])  # the stop token's text is left out


def test_eos_and_min_tokens(engine, tokenizer):
    from conveyor.engine.chat import chat_prompt

    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 2? Reply with the number only."}])
    natural = run(engine, {"n": (prompt, greedy(max_tokens=24))})[0]["n"].outputs[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None
    assert natural.token_ids[-1] == tokenizer.eos_token_id and "<|im_end|>" not in natural.text
    longer = len(natural.token_ids) + 3
    forced = run(engine, {"m": (prompt, greedy(max_tokens=longer + 8, min_tokens=longer))})[0]["m"]
    assert len(forced.outputs[0].token_ids) >= longer  # EOS could not end it before min_tokens
    assert tokenizer.eos_token_id not in forced.outputs[0].token_ids[:longer]  # nor appear in it


def test_n3_with_seed_is_reproducible_and_samples_differ(engine):
    def params(seed):
        return SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)

    finals, _ = run(engine, {"a": (PROMPT, params(1234)), "b": (PROMPT, params(1234)),
                             "o": (PROMPT, params(99))})
    a, b, o = ([c.token_ids for c in finals[k].outputs] for k in "abo")
    assert [c.index for c in finals["a"].outputs] == [0, 1, 2]
    assert a == b and a != o
    assert len({tuple(t) for t in a}) > 1


def test_n_samples_share_the_prompt_blocks(engine, tokenizer):
    block_size = engine.engine_args.block_size
    prompt_ids = tokenizer.encode("A long story about blocks. " * 20)[: 2 * block_size + 5]  # 2 full + partial
    engine.add_request("fork", prompt_ids, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4,
                                                          ignore_eos=True))
    engine.step()  # prefill + the first 3 samples: the group forks into 3 sequences
    (group,) = engine.scheduler.unfinished_groups()
    assert len(group.seqs) == 3
    engine.step()  # one decode each: the partial last block is copied on write
    tables = [s.block_tables[0] for s in group.seqs]
    assert all(len(t) == 3 for t in tables)
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full prompt blocks are shared
    assert len({t[2] for t in tables}) == 3  # each sample writes its own last block
    stats = engine.get_stats()
    assert stats.scheduler.num_total_blocks - stats.scheduler.num_free_blocks == 2 + 3  # unshared it would be 3 * 3
    while engine.has_unfinished_requests():
        engine.step()


def test_logprobs(engine):
    finals, _ = run(engine, {"l": (PROMPT, greedy(max_tokens=4, ignore_eos=True, logprobs=3)),
                             "p": (PROMPT, greedy(max_tokens=2))})
    c = finals["l"].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    for token_id, top in zip(c.token_ids, c.logprobs, strict=True):
        assert token_id in top and 3 <= len(top) <= 4
        assert all(lp.logprob <= 0.0 for lp in top.values())
        assert top[token_id].logprob == max(lp.logprob for lp in top.values())  # greedy
        assert isinstance(top[token_id].decoded_token, str)
    total = sum(top[t].logprob for t, top in zip(c.token_ids, c.logprobs, strict=True))
    assert c.cumulative_logprob == pytest.approx(total)
    plain = finals["p"].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_abort_mid_generation_frees_every_block(engine):
    engine.add_request("keep", PROMPT, greedy(max_tokens=6, ignore_eos=True))
    engine.add_request("drop", PROMPT + " and", greedy(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("queued", "Hello", greedy(max_tokens=2))  # still waiting when aborted
    before = engine.get_stats().scheduler.num_free_blocks
    aborted = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 200
    assert engine.get_stats().scheduler.num_free_blocks > before
    assert engine.abort_request("drop") is None and engine.abort_request("never-added") is None
    waiting = engine.abort_request("queued")
    assert waiting.outputs[0].finish_reason == "abort" and waiting.outputs[0].token_ids == []
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["keep"] and len(finals["keep"].outputs[0].token_ids) == 6
    assert engine.get_stats().finished_by_reason["abort"] >= 2


def test_over_long_prompt_is_ignored_while_the_rest_completes(engine, tokenizer):
    long_ids = (tokenizer.encode(PROMPT) * 40)[: engine.max_model_len + 10]
    finals, _ = run(engine, {"short1": (PROMPT, greedy(max_tokens=3, ignore_eos=True)),
                             "long": (long_ids, greedy(max_tokens=3)),
                             "short2": ("Hello there", greedy(max_tokens=3, ignore_eos=True))})
    long = finals["long"]
    assert long.outputs[0].finish_reason == "ignored" and long.outputs[0].token_ids == []
    assert long.finish_message and str(engine.max_model_len) in long.finish_message
    assert [len(finals[k].outputs[0].token_ids) for k in ("short1", "short2")] == [3, 3]


def test_bad_input_raises_and_leaves_engine_undisturbed(engine):
    engine.add_request("running", PROMPT, greedy(max_tokens=3, ignore_eos=True))
    engine.step()
    bad = [("", greedy(), "prompt"), ([], greedy(), "prompt_token_ids"),
           ([1, 10**9], greedy(), "prompt_token_ids"), ([1, "x"], greedy(), "prompt_token_ids"),
           ({"prompt": 3}, greedy(), "prompt"), (PROMPT, {"temperature": 0}, "sampling_params")]
    for prompt, params, field in bad:
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("running", PROMPT, greedy())
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("bad", PROMPT, SamplingParams(top_p=0))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["running"] and len(finals["running"].outputs[0].token_ids) == 3


def test_stats_count_tokens_and_finish_reasons(engine):
    before = engine.get_stats()
    run(engine, {"x": ("Counting: one", greedy(max_tokens=3, ignore_eos=True)),
                 "y": ("Counting: two", greedy(max_tokens=2, ignore_eos=True))})
    after = engine.get_stats()
    assert after.generation_tokens_total - before.generation_tokens_total == 5
    assert after.prompt_tokens_total > before.prompt_tokens_total
    assert after.finished_by_reason["length"] - before.finished_by_reason.get("length", 0) == 2
    assert after.num_steps == before.num_steps + 3


STORIES = [f"Story number {i}: once upon a time there was a" for i in range(4)]


@pytest.fixture(scope="module")
def stories_reference(llm):
    """Greedy outputs of STORIES on the roomy shared engine."""
    finals = run(llm.llm_engine, {p: (p, greedy(max_tokens=12, ignore_eos=True)) for p in STORIES})[0]
    return {p: finals[p].outputs[0] for p in STORIES}


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "preemption_mode"), [("prefill_first", "recompute"), ("chunked", "swap")])
def test_preemption_under_a_tiny_cache_gives_the_same_tokens(engine, stories_reference, policy,
                                                            preemption_mode):
    """Four requests in a KV cache too small for all of them: the scheduler must preempt, and
    greedy outputs (float32) must still equal the roomy shared engine's."""
    import copy

    from conveyor.engine.llm_engine import LLMEngine

    args = engine.engine_args.replace(num_gpu_blocks=8, block_size=4, policy=policy,
                                      preemption_mode=preemption_mode, max_num_batched_tokens=64,
                                      max_model_len=64, swap_space=0.01)
    small = LLMEngine(args, executor=copy.copy(engine.executor))  # same weights, its own cache
    finals = run(small, {p: (p, greedy(max_tokens=12, ignore_eos=True)) for p in STORIES})[0]
    assert small.get_stats().scheduler.num_preemptions > 0
    for p in STORIES:
        assert finals[p].outputs[0].token_ids == stories_reference[p].token_ids
        assert finals[p].outputs[0].text == stories_reference[p].text
    stats = small.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks == 8
