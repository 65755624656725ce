"""LoRA in the scheduler: at most ``max_loras`` distinct adapters run at once under both
policies; a request of another adapter lets the requests behind it by, and one running adapter
drains so that it gets its turn; a request waits while its adapter's weights load; prefix-cache
blocks are keyed by adapter."""

from __future__ import annotations

import pytest
from core_fakes import FakeExecutor, make_scheduler, run_to_completion, step

from conveyor.core.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_at_most_max_loras_adapters_run_at_once(policy: str) -> None:
    sched = make_scheduler(policy=policy, max_loras=2)
    ex = FakeExecutor(sched)
    for k, lora in enumerate([1, 0, 2, 1, 3, 0, 2]):
        sched.add_request(f"r{k}", [5 + k] * 6, SP, lora_id=lora)
    finished = []
    while sched.has_unfinished_requests():
        out, done = step(sched, ex)
        running = {s.group.lora_id for s in (*sched.running, *sched.prefilling)
                   if not s.status.is_finished and s.group.lora_id}
        assert len(running) <= 2, running
        assert len({s.group.lora_id for s in out.seqs if s.group.lora_id}) <= 2
        finished += [g.request_id for g in done]
    assert sorted(finished) == [f"r{k}" for k in range(7)]


def test_without_a_limit_every_adapter_runs_together() -> None:
    sched = make_scheduler()
    for k in range(5):
        sched.add_request(f"r{k}", [7] * 6, SP, lora_id=k + 1)
    assert len(sched.schedule().seqs) == 5


def test_prefix_blocks_are_keyed_by_adapter() -> None:
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    prompt = list(range(1, 19))
    sched.add_request("a", prompt, SP, lora_id=1)
    run_to_completion(sched, ex)
    for rid, lora, cached in (("b", 2, 0), ("c", 0, 0), ("d", 1, 16)):
        sched.add_request(rid, prompt, SP, lora_id=lora)
        out = sched.schedule()
        assert out.seqs[0].group.metrics.num_cached_tokens == cached, rid
        sched.update(out, ex.execute(out))
        run_to_completion(sched, ex)
    with pytest.raises(ValueError, match="lora_id"):
        sched.add_request("e", prompt, SP, lora_id=-1)


def _started(sched, ex, steps: int, seen: list[str]) -> list[str]:
    """``seen`` then the request ids in the order they were first scheduled, over ``steps``
    steps."""
    for _ in range(steps):
        out, _ = step(sched, ex)
        seen += [s.group.request_id for s in out.seqs if s.group.request_id not in seen]
    return seen


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_a_waiting_adapter_lets_others_by_and_drains_one_slot(policy: str) -> None:
    sched = make_scheduler(policy=policy, max_loras=1)
    ex = FakeExecutor(sched)
    long = SamplingParams(max_tokens=6, ignore_eos=True)
    sched.add_request("one", [5] * 6, long, lora_id=1)
    step(sched, ex)
    # adapter 2 finds no slot: the base request behind it goes ahead, adapter 1 (the running
    # one it waits for) takes no new request until adapter 2 has run
    sched.add_request("two", [6] * 6, SP, lora_id=2)
    sched.add_request("base", [7] * 6, SP)
    sched.add_request("one-more", [8] * 6, SP, lora_id=1)
    started = _started(sched, ex, 40, ["one"])
    assert started == ["one", "base", "two", "one-more"], started
    assert not sched.has_unfinished_requests()


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_a_waiting_adapter_is_not_starved_by_a_busy_one(policy: str) -> None:
    sched = make_scheduler(policy=policy, max_loras=1)
    ex = FakeExecutor(sched)
    sched.add_request("busy-0", [5] * 6, SP, lora_id=1)
    sched.add_request("other", [6] * 6, SP, lora_id=2)
    for k in range(1, 30):  # adapter 1 gets a new request every step
        sched.add_request(f"busy-{k}", [5 + k % 3] * 6, SP, lora_id=1)
        out, _ = step(sched, ex)
        if any(s.group.request_id == "other" for s in out.seqs):
            break
    else:
        pytest.fail("the request of adapter 2 never started")
    assert k <= 6, k  # as soon as adapter 1's first request finished


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_requests_wait_for_their_adapters_weights(policy: str) -> None:
    sched = make_scheduler(policy=policy, max_loras=2)
    ex = FakeExecutor(sched)
    sched.loaded_loras = {1}
    sched.add_request("two", [6] * 6, SP, lora_id=2)
    sched.add_request("one", [5] * 6, SP, lora_id=1)
    out = sched.schedule()
    assert [s.group.request_id for s in out.seqs] == ["one"]
    sched.update(out, ex.execute(out))
    while sched.running or sched.prefilling:
        step(sched, ex)
    out = sched.schedule()  # only "two" is left, its adapter still loading: an empty step
    assert out.is_empty and sched.has_unfinished_requests()
    sched.update(out, ex.execute(out))
    sched.loaded_loras = {1, 2}
    assert [s.group.request_id for s in sched.schedule().seqs] == ["two"]
