"""SchedulerConfig / CacheConfig validation messages, and the request queues."""

from __future__ import annotations

import json

import pytest
from core_fakes import make_scheduler

from conveyor.core.config import (
    CacheConfig,
    PreemptionMode,
    QueueOrder,
    SchedulerConfig,
    SchedulingPolicy,
)
from conveyor.core.request_queue import FcfsQueue, PriorityQueue
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import Sequence, SequenceGroup, SequenceStatus


@pytest.mark.parametrize(("kw", "words"), [
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens must be an integer"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"policy": "fastest"}, "policy must be one of 'prefill_first', 'chunked'"),
    ({"queue": "lifo"}, "queue must be one of"),
    ({"preemption_mode": "kill"}, "preemption_mode must be one of"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "raise max_num_batched_tokens or lower"),
])
def test_scheduler_config_errors_say_what_to_change(kw, words):
    args = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 256} | kw
    with pytest.raises(ValueError, match=words):
        SchedulerConfig(**args)


@pytest.mark.parametrize(("kw", "words"), [
    ({"block_size": 0}, "block_size must be an integer >= 1"),
    ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be a bool"),
])
def test_cache_config_errors_say_what_to_change(kw, words):
    with pytest.raises(ValueError, match=words):
        CacheConfig(**({"block_size": 16, "num_gpu_blocks": 10} | kw))


def test_choices_given_as_strings_become_their_enum_members():
    cfg = SchedulerConfig(8, 256, 256, policy="chunked", queue="priority", preemption_mode="swap")
    assert cfg.policy is SchedulingPolicy.CHUNKED
    assert cfg.queue is QueueOrder.PRIORITY
    assert cfg.preemption_mode is PreemptionMode.SWAP
    member = SchedulerConfig(8, 256, 256, policy=SchedulingPolicy.CHUNKED)
    assert member.policy is SchedulingPolicy.CHUNKED
    # members still read as their strings: in messages, JSON and comparisons
    assert (str(cfg.policy), f"{cfg.queue}", f"{cfg.preemption_mode:>5}") == \
        ("chunked", "priority", " swap")
    assert json.dumps({"policy": cfg.policy}) == '{"policy": "chunked"}'
    assert cfg.policy == "chunked" and SchedulingPolicy.values() == ["prefill_first", "chunked"]


def test_a_bad_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"queue must be one of 'fcfs', 'priority', got 'lifo'"):
        QueueOrder.parse("lifo", "queue")
    with pytest.raises(ValueError, match="preemption_mode must be one of 'recompute', 'swap', got 3"):
        SchedulerConfig(8, 256, 256, preemption_mode=3)


def test_swap_without_a_cpu_pool_is_rejected():
    with pytest.raises(ValueError, match="num_cpu_blocks > 0"):
        Scheduler(SchedulerConfig(8, 256, 256, preemption_mode="swap"),
                  CacheConfig(block_size=16, num_gpu_blocks=10, num_cpu_blocks=0))


def test_prefill_first_bounds_sequences_by_the_step_budget():
    assert SchedulerConfig(8, 256, 1024).max_seq_len == 256
    assert SchedulerConfig(8, 256, 1024, policy="chunked").max_seq_len == 1024
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=64)
    group = sched.add_request("a", [1] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    assert group.seqs[0].max_len == 16


def _seq(seq_id: int, priority: int = 0, arrival: float = 0.0) -> Sequence:
    g = SequenceGroup(f"r{seq_id}", [1], SamplingParams(), priority, arrival)
    s = Sequence(seq_id, g, 0, [1], 1)
    g.seqs.append(s)
    return s


def test_fcfs_queue_order_front_and_lazy_removal():
    q = FcfsQueue(SequenceStatus.WAITING)
    a, b, c = _seq(0), _seq(1), _seq(2)
    q.append(a)
    q.append(b)
    q.push_front(c)
    assert list(q) == [c, a, b] and len(q) == 3
    a.status = SequenceStatus.FINISHED_ABORTED
    q.remove(a)
    assert len(q) == 2 and q.pop() is c and q.peek() is b and q.pop() is b
    assert not q and q.peek() is None and len(q) == 0
    with pytest.raises(IndexError):
        q.pop()


def test_priority_queue_orders_by_priority_then_arrival_then_sequence():
    q = PriorityQueue(SequenceStatus.WAITING)
    s1, s2, s3, s4 = _seq(3, 1, 5.0), _seq(1, 0, 9.0), _seq(2, 1, 5.0), _seq(0, 1, 1.0)
    for s in (s1, s2, s3, s4):
        q.append(s)
    assert list(q) == [s2, s4, s3, s1]
    s4.status = SequenceStatus.FINISHED_ABORTED
    q.remove(s4)
    assert len(q) == 3
    assert [q.pop(), q.pop(), q.pop()] == [s2, s3, s1] and not q


def test_core_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, conveyor.core.scheduler, conveyor.core.chunked, conveyor.core.prefill_first, "
            "conveyor.bench.scheduler; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
