"""Round-robin admission across fairness keys: one client's many requests cannot hold another
client's request back behind all of them (``core/request_queue``)."""

from __future__ import annotations

import pytest
from core_fakes import FakeExecutor, check_invariants, make_scheduler, run_to_completion, step

from conveyor.core.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _admission_order(policy: str, queue: str, keyed: bool) -> tuple[list[str], int]:
    """Twelve requests of client A (n=2 each), a few steps, then one of client B, with two
    seats. The order in which requests are first scheduled, and how many were before B came."""
    sched = make_scheduler(max_num_seqs=2, policy=policy, queue=queue)
    executor = FakeExecutor(sched)
    for i in range(12):
        sched.add_request(f"a{i}", [1, 2, 3, 4, 5], SamplingParams(n=2, max_tokens=6,
                                                                   ignore_eos=True),
                          fairness_key="A" if keyed else None)
    order: list[str] = []
    for _ in range(3):  # A's first request runs a little before B arrives
        out, _ = step(sched, executor)
        order += [s.group.request_id for s in out.seqs if s.group.request_id not in order]
    arrived = len(order)
    sched.add_request("b", [7, 8, 9], PARAMS, fairness_key="B" if keyed else None)
    while sched.has_unfinished_requests():
        out, _ = step(sched, executor)
        check_invariants(sched)
        order += [s.group.request_id for s in out.seqs if s.group.request_id not in order]
    return order, arrived


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_another_clients_request_waits_for_at_most_one_more(policy: str, queue: str) -> None:
    fair, arrived = _admission_order(policy, queue, keyed=True)
    assert 0 < arrived < 12
    # b is admitted before any A request that was still waiting when b arrived, save one
    # (the one a step may take together with b)
    assert fair.index("b") <= arrived + 1, fair
    # without keys, every request is its own client: plain arrival order, b last
    unkeyed, _ = _admission_order(policy, queue, keyed=False)
    assert unkeyed[-1] == "b"


def test_one_key_keeps_arrival_order_and_keys_alternate() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for i in range(3):
        sched.add_request(f"a{i}", [1, 2], PARAMS, fairness_key="A")
    for i in range(3):
        sched.add_request(f"b{i}", [3, 4], PARAMS, fairness_key="B")
    sched.add_request("c0", [5, 6], PARAMS, fairness_key="C")
    assert [s.group.request_id for s in sched.waiting] == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]
    run_to_completion(sched)
