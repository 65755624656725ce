"""The core's side of structured outputs: StructuredOutputsParams checks what pure Python can
when it is built, and the scheduler holds a request WAITING_FOR_GRAMMAR (never scheduled, its
abort frees it) until grammar_ready() queues it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import SequenceStatus
from conveyor.core.structured_outputs_params import StructuredOutputsParams as S


def test_checking_a_constraint_stays_torch_free() -> None:
    code = ("import sys\n"
            "from conveyor.core.sampling_params import SamplingParams\n"
            "from conveyor.core.structured_outputs_params import StructuredOutputsParams as S\n"
            "SamplingParams(structured_outputs=S(json={'type': 'object'}))\n"
            "SamplingParams(structured_outputs=S(regex='[0-9]+'))\n"
            "print(sorted({'torch', 'xgrammar'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"json": {"type": "objekt"}}, "not a valid JSON schema: 'objekt' is not valid"),
    ({"json": {"type": "integer", "minimum": "zero"}}, "not a valid JSON schema"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON schema object"),
    ({"regex": "a(b"}, "structured_outputs.regex is not a valid regex: missing )"),
    ({"choice": []}, "non-empty list of non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty list of non-empty strings"),
    ({"grammar": "  "}, "non-empty EBNF string"),
    ({}, "needs exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
])
def test_bad_constraints_raise_value_error_naming_the_problem(kwargs, message) -> None:
    with pytest.raises(ValueError, match="structured_outputs|StructuredOutputsParams") as info:
        S(**kwargs)
    assert message in str(info.value)


def test_good_constraints_and_their_cache_keys() -> None:
    a = S(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    b = S(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.key() == b.key() and a.kind == "json"  # key order does not matter
    assert S(choice=["x", "y"]).key() != S(choice=["y", "x"]).key()
    assert S(json_object=True).kind == "json_object"
    params = SamplingParams(structured_outputs=S(regex="[0-9]+"))
    assert params.structured_outputs.regex == "[0-9]+"
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be"):
        SamplingParams(structured_outputs={"regex": "x"})


def test_a_request_waits_for_its_grammar_then_runs() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks=16))
    params = SamplingParams(max_tokens=2, structured_outputs=S(choice=["a"]))
    held = sched.add_request("g", [1, 2, 3], params, wait_for_grammar=True)
    sched.add_request("p", [4, 5], SamplingParams(max_tokens=2))
    assert held.seqs[0].status is SequenceStatus.WAITING_FOR_GRAMMAR
    assert not held.seqs[0].status.is_finished and sched.stats.num_waiting == 2
    out = sched.schedule()
    assert [s.group.request_id for s in out.seqs] == ["p"]  # the other request runs meanwhile
    sched.update(out, [[7]])
    sched.grammar_ready("g")
    assert held.seqs[0].status is SequenceStatus.WAITING
    out = sched.schedule()
    assert "g" in [s.group.request_id for s in out.seqs]


def test_aborting_a_request_waiting_for_its_grammar() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks=16))
    params = SamplingParams(structured_outputs=S(choice=["a"]))
    sched.add_request("g", [1, 2, 3], params, wait_for_grammar=True)
    group = sched.abort("g")
    assert group.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert not sched.waiting_for_grammar and not sched.has_unfinished_requests()
    sched.grammar_ready("g")  # a compile finishing after the abort changes nothing
    assert not sched.waiting
