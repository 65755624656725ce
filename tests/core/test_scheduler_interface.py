"""The policies drive the Scheduler only through SchedulerInterface, and ``stats`` is a pure
snapshot (reading it changes nothing, and it counts what the queues really hold)."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
from core_fakes import FakeExecutor, make_scheduler

import conveyor.core as core_pkg
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler_interface import SchedulerInterface
from conveyor.core.sequence import SequenceStatus

POLICY_MODULES = ["prefill_first.py", "chunked.py", "decode.py"]


def test_scheduler_implements_the_interface():
    assert isinstance(make_scheduler(), SchedulerInterface)
    assert isinstance(make_scheduler(policy="chunked"), SchedulerInterface)


def _interface_members() -> set[str]:
    members = set(SchedulerInterface.__annotations__)
    members |= {n for n, v in vars(SchedulerInterface).items() if callable(v) and not n.startswith("_")}
    return members


def _attributes_read_on_sched(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "sched"}


@pytest.mark.parametrize("module", POLICY_MODULES)
def test_policies_use_only_the_interface(module):
    used = _attributes_read_on_sched(Path(core_pkg.__file__).parent / module)
    assert used, f"{module} no longer drives a `sched`: update POLICY_MODULES"
    assert used <= _interface_members(), f"{module} uses {sorted(used - _interface_members())}"


def _truly_running(sched) -> int:
    return sum(s.status is SequenceStatus.RUNNING
               for g in sched.unfinished_groups() for s in g.seqs)


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
@pytest.mark.parametrize("seed", range(6))
def test_stats_is_a_pure_snapshot(policy, seed):
    """Sequences finish (some at their first token, some after forking, some aborted) while
    others keep running; after every step stats must count exactly the live ones and leave
    ``running`` as it was."""
    rng = random.Random(seed)
    sched = make_scheduler(block_size=2, num_gpu_blocks=200, max_num_seqs=32, policy=policy)
    ex = FakeExecutor(sched)
    n_added = 0
    for step in range(120):
        for _ in range(rng.randint(0, 3)):
            sp = SamplingParams(max_tokens=rng.choice([1, 2, 5, 20]), n=rng.choice([1, 1, 3]),
                                ignore_eos=True)
            sched.add_request(f"r{n_added}", [rng.randrange(1, 20) for _ in range(rng.randint(1, 9))], sp)
            n_added += 1
        if step % 7 == 3 and sched.unfinished_groups():
            sched.abort(rng.choice(sched.unfinished_groups()).request_id)
        if not sched.has_unfinished_requests():
            continue
        out = sched.schedule()
        sched.update(out, ex.execute(out))
        running_before = list(sched.running)
        first = sched.stats
        assert sched.stats == first
        assert sched.running == running_before
        assert first.num_running == _truly_running(sched)
        assert first.num_waiting == len(sched.waiting)
    assert n_added > 50


def test_stats_after_a_few_and_after_many_finish():
    """Both ways of counting the stopped sequences still in ``running``: one by one (a few
    stopped among many) and by filtering (most stopped)."""
    sched = make_scheduler(block_size=4, num_gpu_blocks=200, max_num_seqs=32)
    ex = FakeExecutor(sched)
    for i in range(20):
        sched.add_request(f"long{i}", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, ex.execute(out))
    sched.abort("long3")
    assert sched.stats.num_running == 19 and len(sched.running) == 20
    for i in range(4, 20):
        sched.abort(f"long{i}")
    assert sched.stats.num_running == 3 and len(sched.running) == 20
