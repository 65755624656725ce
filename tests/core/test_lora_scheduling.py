"""LoRA in the scheduler: at most ``max_loras`` distinct adapters run at once under both
policies (a request of another adapter waits at the head, then runs), and prefix-cache blocks
are keyed by adapter."""

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
