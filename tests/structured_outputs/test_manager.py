"""StructuredOutputManager and its compile cache on the real SmolLM2 tokenizer: one compile per
constraint, a failed compile explains itself, and a matcher follows its sequence's tokens
(replaying new ones, rolling back removed ones), and a constraint that waits for the end of the
reasoning starts after it."""

from __future__ import annotations

import pytest

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceGroup
from conveyor.core.structured_outputs_params import StructuredOutputsParams as S
from conveyor.model.loader import default_model_path
from conveyor.structured_outputs import (
    GrammarCompileCache,
    StructuredOutputManager,
    tokenizer_info,
)

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from conveyor.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCompileCache(tokenizer_info(tokenizer, VOCAB, [EOS]))


def test_one_compile_per_constraint(cache) -> None:
    a = cache.submit(S(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = cache.submit(S(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b and a.result() is not None


@pytest.mark.parametrize(("params", "message"), [
    (S(grammar="root ::= ("), "structured_outputs.grammar cannot be compiled: EBNF parser error"),
    (S(regex="(?<=a)b"), "structured_outputs.regex cannot be compiled: Regex parsing error"),
])
def test_a_failed_compile_says_why_and_is_not_cached(cache, params, message) -> None:
    with pytest.raises(ValueError) as info:
        cache.compile(params)
    assert str(info.value).startswith(message)
    failed = cache.submit(params)
    assert failed.exception() is not None
    again = cache.submit(params)
    assert again is not failed  # a failure is not remembered: it compiles again
    cache.release(failed)
    cache.release(again)


def _group(tokenizer, params: SamplingParams, prompt: list[int]) -> tuple[SequenceGroup, Sequence]:
    group = SequenceGroup("r", prompt, params, 0, 0.0)
    seq = Sequence(0, group, 0, list(prompt), len(prompt))
    group.seqs.append(seq)
    return group, seq


def _allowed(manager, seq) -> set[int]:
    out = SchedulerOutput(seqs=[seq], num_new_tokens=[1])
    seq.num_computed_tokens = len(seq.token_ids) - 1
    mask = manager.bitmask(out)
    words = mask.bitmask[mask.row_of[seq.seq_id]].tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if word >> b & 1}


def test_the_matcher_replays_and_rolls_back_with_its_sequence(tokenizer, cache) -> None:
    manager = StructuredOutputManager(cache, VOCAB)
    params = SamplingParams(structured_outputs=S(choice=["yes", "no"]))
    group, seq = _group(tokenizer, params, [1, 2, 3])
    manager.add_request(group)
    assert manager.poll(wait_s=5.0) == (["r"], [])
    first = _allowed(manager, seq)
    assert {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")} <= first
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    seq.token_ids.append(yes)  # replayed at the next use: only the grammar's end is left
    assert _allowed(manager, seq) == {EOS}
    seq.token_ids.append(EOS)
    assert manager.advance([seq]) == [seq]  # the grammar has ended: the sequence must stop
    del seq.token_ids[-2:]  # e.g. speculative tokens taken back: the matcher rolls back
    assert _allowed(manager, seq) == first
    manager.remove("r")
    assert not manager.is_constrained("r")


def test_a_constraint_waiting_for_the_end_of_reasoning_starts_after_it(tokenizer, cache) -> None:
    manager = StructuredOutputManager(cache, VOCAB)
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    params = SamplingParams(structured_outputs=S(choice=["yes", "no"], reasoning_end=end))
    group, seq = _group(tokenizer, params, [1, 2, 3])
    manager.add_request(group)
    assert manager.poll(wait_s=5.0) == (["r"], [])
    out = SchedulerOutput(seqs=[seq], num_new_tokens=[1])
    assert manager.bitmask(out) is None  # reasoning: unconstrained
    seq.token_ids += tokenizer.encode("I think yes", add_special_tokens=False) + list(end[:-1])
    assert manager.bitmask(out) is None and manager.advance([seq]) == []
    seq.token_ids.append(end[-1])  # the reasoning has ended: the choice is constrained now
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    assert yes in _allowed(manager, seq) and EOS not in _allowed(manager, seq)
    seq.token_ids += [yes, EOS]
    assert manager.advance([seq]) == [seq]
    del seq.token_ids[-3:]  # taken back to before the marker's end: reasoning again
    assert manager.bitmask(out) is None
    seq.token_ids.append(end[-1])
    allowed = _allowed(manager, seq)
    assert yes in allowed and EOS not in allowed


def test_a_reply_that_may_open_reasoning_is_constrained_unless_it_does(tokenizer, cache) -> None:
    manager = StructuredOutputManager(cache, VOCAB)
    start = tuple(tokenizer.encode("<think>", add_special_tokens=False))
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    params = SamplingParams(structured_outputs=S(choice=["yes", "no"], reasoning_start=start,
                                                 reasoning_end=end))
    group, seq = _group(tokenizer, params, [1, 2, 3])
    manager.add_request(group)
    assert manager.poll(wait_s=5.0) == (["r"], [])
    first = _allowed(manager, seq)
    assert start[0] in first and yes in first  # the grammar's tokens or the marker's
    seq.token_ids.append(start[0])
    assert _allowed(manager, seq) == {start[1]}  # the grammar cannot follow "<": only the marker
    assert manager.advance([seq]) == []
    seq.token_ids += list(start[1:]) + tokenizer.encode("hmm", add_special_tokens=False)
    out = SchedulerOutput(seqs=[seq], num_new_tokens=[1])
    assert manager.bitmask(out) is None  # reasoning
    seq.token_ids += list(end)
    assert yes in _allowed(manager, seq) and start[0] not in _allowed(manager, seq)
    del seq.token_ids[3:]  # another reply, without reasoning: constrained from its first token
    seq.token_ids.append(yes)
    assert _allowed(manager, seq) == {EOS}
