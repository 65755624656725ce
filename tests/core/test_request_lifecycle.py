"""A request's life: validation, ignored prompts, stop rules, n>1 fork with copy-on-write,
abort from every queue, engine-side finishing, metrics and stats."""

from __future__ import annotations

import pytest
from core_fakes import EOS, FakeExecutor, ids, make_scheduler, run_to_completion, step

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import SequenceStatus as S


class ScriptedExecutor:
    """Samples scripted tokens: ``script[request_id]`` is one token list per sample index
    (or a flat list for n=1); past its end the last token repeats."""

    def __init__(self, script: dict[str, list]) -> None:
        self.script = {k: v if isinstance(v[0], list) else [v] for k, v in script.items()}

    def execute(self, out: SchedulerOutput) -> list[list[int]]:
        sampled = []
        for i, seq in enumerate(out.seqs):
            per_index = self.script[seq.group.request_id]
            pos = seq.num_output_tokens
            k = out.num_samples(i)
            indices = range(k) if k > 1 else [seq.index] * k
            sampled.append([per_index[j][min(pos, len(per_index[j]) - 1)] for j in indices])
        return sampled


def _run_script(tokens: list[int], sp: SamplingParams, prompt_len: int = 5, **kw):
    sched = make_scheduler(**kw)
    sched.add_request("r", list(range(1, prompt_len + 1)), sp)
    ex = ScriptedExecutor({"r": tokens})
    done = run_to_completion(sched, ex)
    return done["r"].seqs[0]


# ---------------------------------------------------------------------- validation

def test_add_request_rejects_bad_input_and_queues_nothing():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request("a", [1, -2], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        sched.add_request("a", [1], {"max_tokens": 3})
    with pytest.raises(ValueError, match="priority"):
        sched.add_request("a", [1], SamplingParams(), priority="high")
    sched.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("a", [3], SamplingParams())
    assert sched.stats.num_waiting == 1


# ---------------------------------------------------------------------- ignored prompts

@pytest.mark.parametrize(("prompt_len", "kw", "words"), [
    (30, {"max_model_len": 20}, "max_model_len=20"),
    (30, {"num_gpu_blocks": 7, "block_size": 4}, "whole cache has 7"),
    (30, {"max_num_batched_tokens": 16, "max_model_len": 64}, "policy 'chunked'"),
])
def test_prompt_that_can_never_run_is_ignored_with_a_message(prompt_len, kw, words):
    sched = make_scheduler(**kw)
    group = sched.add_request("big", list(range(1, prompt_len + 1)), SamplingParams())
    sched.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    assert group.seqs[0].status is S.FINISHED_IGNORED and words in group.finish_message
    assert group.seqs[0].status.finish_reason == "ignored"
    out = sched.schedule()
    assert ids(out.seqs) == ["ok"]
    ex = FakeExecutor(sched)
    finished = sched.update(out, ex.execute(out))
    assert [g.request_id for g in finished] == ["big"]
    assert run_to_completion(sched, ex).keys() == {"ok"}


def test_chunked_policy_runs_prompts_longer_than_the_step_budget():
    sched = make_scheduler(policy="chunked", max_num_batched_tokens=16, max_model_len=64)
    sched.add_request("long", list(range(1, 41)), SamplingParams(max_tokens=2))
    done = run_to_completion(sched, check=True)
    assert done["long"].seqs[0].status is S.FINISHED_LENGTH_CAPPED


# ---------------------------------------------------------------------- stop rules

def test_eos_stops_with_no_stop_reason():
    seq = _run_script([5, 6, EOS, 7], SamplingParams(max_tokens=10))
    assert seq.output_token_ids == [5, 6, EOS]
    assert seq.status is S.FINISHED_STOPPED and seq.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    seq = _run_script([5, EOS, EOS, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert seq.output_token_ids == [5, EOS, EOS, 7]
    assert seq.status is S.FINISHED_LENGTH_CAPPED and seq.status.finish_reason == "length"


def test_stop_token_ids_stop_with_the_token_as_reason():
    seq = _run_script([5, 9, 6], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    assert seq.output_token_ids == [5, 9] and seq.stop_reason == 9


def test_min_tokens_suppresses_stopping():
    seq = _run_script([EOS, 9, EOS, 4], SamplingParams(max_tokens=10, min_tokens=3,
                                                      stop_token_ids=[9]))
    assert seq.output_token_ids == [EOS, 9, EOS] and seq.status is S.FINISHED_STOPPED


def test_max_model_len_caps_the_sequence():
    seq = _run_script([5] * 50, SamplingParams(max_tokens=None), prompt_len=5, max_model_len=12,
                      max_num_batched_tokens=12)
    assert len(seq) == 12 and seq.status is S.FINISHED_LENGTH_CAPPED


def test_max_tokens_one_finishes_at_the_prefill():
    seq = _run_script([5], SamplingParams(max_tokens=1))
    assert seq.output_token_ids == [5] and seq.status is S.FINISHED_LENGTH_CAPPED


# ---------------------------------------------------------------------- n > 1

def test_parallel_samples_fork_after_prefill_and_copy_the_shared_partial_block():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    group = sched.add_request("r", list(range(1, 7)), SamplingParams(n=3, max_tokens=5,
                                                                      ignore_eos=True))
    out = sched.schedule()
    assert out.num_samples(0) == 3 and len(group.seqs) == 1
    sched.update(out, ex.execute(out))
    assert [s.index for s in group.seqs] == [0, 1, 2]
    parent = group.seqs[0]
    assert all(s.block_tables[0] == parent.block_tables[0] for s in group.seqs)
    refs = sched.block_manager.gpu.ref_counts
    assert [refs[b] for b in parent.block_tables[0]] == [3, 3]
    out = sched.schedule()  # each writes position 6, inside the shared partial block
    assert len(out.seqs) == 3 and [out.num_samples(i) for i in range(3)] == [1, 1, 1]
    assert len(out.blocks_to_copy) == 2
    assert len({s.block_tables[0][1] for s in group.seqs}) == 3
    assert len({s.block_tables[0][0] for s in group.seqs}) == 1  # the full block stays shared
    sched.update(out, ex.execute(out))
    done = run_to_completion(sched, ex, check=True)
    assert [len(s.output_token_ids) for s in done["r"].seqs] == [5, 5, 5]
    assert sched.block_manager.gpu.ref_counts == [0] * 64


def test_block_aligned_fork_needs_no_copy():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    sched.add_request("r", list(range(1, 9)), SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    step(sched, ex)
    out = sched.schedule()
    assert out.blocks_to_copy == [] and len(out.seqs) == 2
    sched.update(out, ex.execute(out))


def test_group_finishes_once_all_samples_finish():
    sched = make_scheduler()
    ex = ScriptedExecutor({"r": [[4, 6, 7], [EOS]]})
    sched.add_request("r", [1, 2, 3], SamplingParams(n=2, max_tokens=3))
    out = sched.schedule()
    assert sched.update(out, ex.execute(out)) == []  # samples 4 and EOS: one still runs
    done = run_to_completion(sched, ex)
    statuses = sorted(s.status for s in done["r"].seqs)
    assert statuses == [S.FINISHED_STOPPED, S.FINISHED_LENGTH_CAPPED]


# ---------------------------------------------------------------------- abort

def _all_blocks_free(sched) -> bool:
    gpu = sched.block_manager.gpu
    cpu = sched.block_manager.cpu
    return all(r == 0 for r in gpu.ref_counts) and cpu.num_free == cpu.num_blocks


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "prefilling"])
def test_abort_from_each_queue_frees_every_block(where):
    policy = "chunked" if where == "prefilling" else "prefill_first"
    sched = make_scheduler(block_size=4, num_gpu_blocks=8, num_cpu_blocks=16,
                           preemption_mode="swap", policy=policy,
                           max_num_batched_tokens=16 if policy == "chunked" else 32,
                           max_model_len=32)
    ex = FakeExecutor(sched)
    sched.add_request("a", list(range(1, 14)), SamplingParams(max_tokens=15, ignore_eos=True))
    sched.add_request("b", list(range(20, 31)), SamplingParams(max_tokens=15, ignore_eos=True))
    for _ in range(50):
        st = {s.status for s in sched.unfinished_groups()[-1].seqs}
        if where == "waiting" and st == {S.WAITING}:
            break
        if where == "swapped" and st == {S.SWAPPED}:
            break
        if where == "running" and st == {S.RUNNING} and sched.running:
            break
        if where == "prefilling" and sched.prefilling:
            break
        step(sched, ex)
    else:
        pytest.fail(f"never reached {where}")
    victim = sched.unfinished_groups()[-1]
    group = sched.abort(victim.request_id)
    assert group is victim and all(s.status is S.FINISHED_ABORTED for s in group.seqs)
    assert group.seqs[0].status.finish_reason == "abort" and group.metrics.finished_time
    assert sched.abort(victim.request_id) is None
    for other in sched.unfinished_groups():
        sched.abort(other.request_id)
    assert _all_blocks_free(sched) and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.is_empty
    assert sched.update(out, []) == []


def test_abort_between_schedule_and_update_is_safe():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    sched.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add_request("b", list(range(1, 10)), SamplingParams(max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    sampled = ex.execute(out)
    sched.abort("a")
    assert sched.update(out, sampled) == []
    done = run_to_completion(sched, ex, check=True)
    assert len(done["b"].seqs[0].output_token_ids) == 5
    assert _all_blocks_free(sched)


def test_finish_sequence_from_the_engine_frees_blocks():
    sched = make_scheduler()
    ex = FakeExecutor(sched)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    _, _ = step(sched, ex)
    seq = sched.running[0]
    group = sched.finish_sequence(seq, S.FINISHED_STOPPED, "stop string")
    assert group is seq.group and seq.stop_reason == "stop string"
    assert not sched.has_unfinished_requests() and _all_blocks_free(sched)
    assert sched.finish_sequence(seq, S.FINISHED_STOPPED) is None
    out = sched.schedule()
    assert out.is_empty and sched.update(out, []) == []


# ---------------------------------------------------------------------- metrics and stats

def test_metrics_come_from_the_scheduler_clock():
    sched = make_scheduler()  # the clock ticks 1.0, 2.0, ... on every call
    ex = FakeExecutor(sched)
    group = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True),
                              arrival_time=0.5)
    run_to_completion(sched, ex)
    m = group.metrics
    assert m.arrival_time == 0.5
    assert 0.5 < m.first_scheduled_time <= m.first_token_time < m.finished_time
    assert m.num_preemptions == 0 and m.num_cached_tokens == 0


def test_stats_snapshot():
    sched = make_scheduler(block_size=4, num_gpu_blocks=10)
    ex = FakeExecutor(sched)
    sched.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request("b", list(range(1, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    step(sched, ex)
    s = sched.stats
    assert (s.num_running, s.num_waiting, s.num_swapped) == (1, 1, 0)
    assert s.num_total_blocks == 10 and s.num_free_blocks == 7
    assert s.kv_usage == pytest.approx(0.3)


def test_a_step_without_progress_is_reported_not_spun():
    sched = make_scheduler()
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    sched._policy = lambda s: SchedulerOutput()  # a policy bug: queued work, nothing scheduled
    with pytest.raises(RuntimeError, match="no progress"):
        sched.schedule()
