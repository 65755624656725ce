"""The seeds' worked example (max_num_seqs=4, max_num_batched_tokens=1024, prompts 500/300/400/200)
and their preemption scenario, as written."""

from __future__ import annotations

from core_fakes import FakeExecutor

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import SequenceStatus


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 30000 for i in range(n)]


def _scheduler(num_gpu_blocks: int, block_size: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024),
                     CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks))


def test_worked_example_prefills_first_two_then_the_rest_then_decodes():
    sched = _scheduler(num_gpu_blocks=1000, block_size=16)
    ex = FakeExecutor(sched)
    for i, n in enumerate([500, 300, 400, 200], start=1):
        sched.add_request(f"Seq{i}", _prompt(n, i), SamplingParams(max_tokens=8, ignore_eos=True))

    out = sched.schedule()  # Seq1: 500 <= 1024; Seq2: 800 <= 1024; Seq3: 1200 > 1024 -> stop
    assert out.is_prefill
    assert [s.group.request_id for s in out.seqs] == ["Seq1", "Seq2"]
    assert out.num_new_tokens == [500, 300] and out.num_batched_tokens == 800
    assert [s.group.request_id for s in sched.waiting] == ["Seq3", "Seq4"]
    assert [s.group.request_id for s in sched.running] == ["Seq1", "Seq2"]
    sched.update(out, ex.execute(out))
    assert [len(s) for s in sched.running] == [501, 301]

    out = sched.schedule()  # waiting first: Seq3 + Seq4 = 600 tokens
    assert out.is_prefill and [s.group.request_id for s in out.seqs] == ["Seq3", "Seq4"]
    sched.update(out, ex.execute(out))

    out = sched.schedule()  # nothing waits: one decode token for each, in running order
    assert not out.is_prefill
    assert [s.group.request_id for s in out.seqs] == ["Seq1", "Seq2", "Seq3", "Seq4"]
    assert out.num_new_tokens == [1, 1, 1, 1]


def test_preemption_scenario_lifo_victim_goes_to_front_of_waiting():
    # 8 blocks of 100 tokens: Seq1 (500) takes 5, Seq2 (300) takes 3. After the prefill both
    # need a new block for their next token and none is free.
    sched = _scheduler(num_gpu_blocks=8, block_size=100)
    ex = FakeExecutor(sched)
    sched.add_request("Seq1", _prompt(500, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request("Seq2", _prompt(300, 2), SamplingParams(max_tokens=50, ignore_eos=True))
    out = sched.schedule()
    assert [s.group.request_id for s in out.seqs] == ["Seq1", "Seq2"]
    sched.update(out, ex.execute(out))
    seq1, seq2 = sched.running
    assert (len(seq1), len(seq2)) == (501, 301) and sched.block_manager.num_free_blocks == 0

    out = sched.schedule()  # Seq1 cannot append -> preempt Seq2 (LIFO) -> Seq1 appends
    assert out.seqs == [seq1] and not out.is_prefill
    assert sched.running == [seq1]
    assert list(sched.waiting) == [seq2] and seq2.status is SequenceStatus.WAITING
    assert seq2.num_computed_tokens == 0 and seq2.block_tables == []
    assert len(seq2) == 301  # keeps its generated token: prompt + output are recomputed
    assert sched.stats.num_preemptions == 1
    sched.update(out, ex.execute(out))
    assert len(seq1) == 502


def test_preempted_sequence_goes_before_later_arrivals():
    sched = _scheduler(num_gpu_blocks=8, block_size=100)
    ex = FakeExecutor(sched)
    sched.add_request("Seq1", _prompt(500, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request("Seq2", _prompt(300, 2), SamplingParams(max_tokens=50, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, ex.execute(out))
    sched.add_request("Seq3", _prompt(100, 3), SamplingParams(max_tokens=5, ignore_eos=True))
    out = sched.schedule()  # Seq3 cannot get a block (none free): decode, preempting Seq2
    assert [s.group.request_id for s in out.seqs] == ["Seq1"]
    assert [s.group.request_id for s in sched.waiting] == ["Seq2", "Seq3"]


def test_last_sequence_preempts_itself_when_no_one_is_left_behind_it():
    # 9 blocks: after the prefill one is free; Seq1 takes it, Seq2 finds none and nobody runs
    # after it, so it preempts itself.
    sched = _scheduler(num_gpu_blocks=9, block_size=100)
    ex = FakeExecutor(sched)
    sched.add_request("Seq1", _prompt(500, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request("Seq2", _prompt(300, 2), SamplingParams(max_tokens=50, ignore_eos=True))
    out = sched.schedule()
    sched.update(out, ex.execute(out))
    seq1, seq2 = sched.running
    out = sched.schedule()
    assert out.seqs == [seq1]
    assert sched.running == [seq1] and list(sched.waiting) == [seq2]


def test_request_filling_the_whole_cache_stops_at_its_capacity():
    sched = _scheduler(num_gpu_blocks=5, block_size=100)
    ex = FakeExecutor(sched)
    sched.add_request("Seq1", _prompt(500, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    out = sched.schedule()
    finished = sched.update(out, ex.execute(out))
    # a 501st token would need a 6th block: the whole cache holds 500 tokens, so it ends there
    seq = out.seqs[0]
    assert [g.request_id for g in finished] == ["Seq1"]
    assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED and len(seq) == 501
    assert sched.block_manager.num_free_blocks == 5
