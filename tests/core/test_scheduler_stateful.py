"""Hypothesis stateful tests: random add / abort / schedule+update over every policy x queue x
preemption mode, with the fake model over a simulated KV cache (core_fakes.FakeExecutor).

After every step: ref counts == owners, free + used == total (GPU and CPU pools), every live
sequence in exactly the queue its status names, len(batch) <= max_num_seqs, tokens per step
<= max_num_batched_tokens, every K/V read matches its prefix. At teardown the scheduler is
drained (liveness: everything finishes within a step bound), every added request has finished
exactly once, and every finished request's tokens equal the reference generated alone — so
recompute, swap and no preemption at all give the same streams. Each combination runs with the
default single full-attention KV-cache group and with random hybrid layouts (full-attention and
sliding-window groups over one pool: every group's reads are checked, window blocks released).
"""

from __future__ import annotations

import itertools

import pytest
from core_fakes import (
    EOS,
    VOCAB,
    FakeExecutor,
    blocks_to_compute,
    check_invariants,
    hybrid_groups,
    reference_outputs,
    seq_limit,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import SequenceStatus
from long_runs import sized

tokens = st.integers(0, VOCAB - 1)


class SchedulerMachine(RuleBasedStateMachine):
    policy = "prefill_first"
    queue = "fcfs"
    mode = "recompute"
    hybrid = False

    @initialize(block_size=st.sampled_from([1, 2, 4, 8]), num_gpu_blocks=st.integers(3, 40),
                max_num_seqs=st.integers(1, 6), budget_extra=st.integers(0, 60),
                max_model_len=st.integers(4, 80), caching=st.booleans(),
                threshold=st.integers(0, 12), partial=st.integers(1, 3),
                num_cpu_blocks=st.integers(1, 40), num_full=st.sampled_from([1, 1, 0, 2]),
                windows=st.lists(st.integers(1, 12), min_size=1, max_size=3))
    def setup(self, block_size, num_gpu_blocks, max_num_seqs, budget_extra, max_model_len,
              caching, threshold, partial, num_cpu_blocks, num_full, windows):
        self.sc = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs + budget_extra,
            max_model_len=max_model_len, policy=self.policy, queue=self.queue,
            preemption_mode=self.mode, long_prefill_token_threshold=threshold,
            max_num_partial_prefills=partial)
        groups = hybrid_groups(num_full, windows) if self.hybrid else ()
        scale = max(1, len(groups))
        self.cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks * scale,
                              num_cpu_blocks=num_cpu_blocks * scale, enable_prefix_caching=caching,
                              kv_cache_groups=groups)
        self.time = itertools.count()
        self.sched = Scheduler(self.sc, self.cc, eos_token_ids=(EOS,),
                               clock=lambda: float(next(self.time)))
        self.ex = FakeExecutor(self.sched)
        self.limit = seq_limit(self.sc, self.cc)
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.finished: dict[str, object] = {}
        self.aborted: set[str] = set()
        self.prompts: list[list[int]] = []

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def add(self, data):
        if self.prompts and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.prompts), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            prompt = base[:cut] + data.draw(st.lists(tokens, max_size=10), label="tail")
        else:
            prompt = data.draw(st.lists(tokens, min_size=1, max_size=40), label="prompt")
        if not prompt:
            prompt = [1]
        self.prompts.append(prompt)
        max_tokens = data.draw(st.integers(1, 16), label="max_tokens")
        sp = SamplingParams(
            n=data.draw(st.integers(1, 3), label="n"), max_tokens=max_tokens,
            min_tokens=data.draw(st.integers(0, max_tokens), label="min_tokens"),
            ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
            stop_token_ids=data.draw(st.lists(tokens, max_size=2), label="stop_token_ids"))
        rid = f"r{len(self.requests)}"
        group = self.sched.add_request(rid, prompt, sp, priority=data.draw(st.integers(0, 3)))
        self.requests[rid] = (prompt, sp)
        blocks = blocks_to_compute(self.cc, len(prompt), self.sc.policy == "prefill_first")
        must_ignore = len(prompt) > self.limit or blocks > self.cc.num_gpu_blocks
        assert (group.seqs[0].status is SequenceStatus.FINISHED_IGNORED) == must_ignore
        if must_ignore:
            assert group.finish_message

    def _abortable(self):
        return [g.request_id for g in self.sched.unfinished_groups()]

    @precondition(lambda self: self._abortable())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self._abortable())), label="abort")
        group = self.sched.abort(rid)
        assert group is not None and group.request_id == rid
        assert all(s.status is SequenceStatus.FINISHED_ABORTED or s.status.is_finished
                   for s in group.seqs)
        self._record(group)
        self.aborted.add(rid)
        assert self.sched.abort(rid) is None
        check_invariants(self.sched)

    def _running(self):
        return [s for s in self.sched.running if s.status is SequenceStatus.RUNNING]

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def stop_string(self, data):
        """The engine finishes a running sequence (a stop string matched)."""
        seq = data.draw(st.sampled_from(self._running()), label="stop")
        rid = seq.group.request_id
        group = self.sched.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, "stop")
        assert seq.status is SequenceStatus.FINISHED_STOPPED and not seq.block_tables
        self.aborted.add(rid)  # its tokens are a prefix of the reference
        if group is not None:
            assert group.is_finished
            self._record(group)
        check_invariants(self.sched)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self._one_step()

    # ------------------------------------------------------------------ helpers

    def _record(self, group):
        assert group.request_id not in self.finished, f"{group.request_id} finished twice"
        self.finished[group.request_id] = group

    def _one_step(self):
        out = self.sched.schedule()
        assert len(out.seqs) <= self.sc.max_num_seqs
        assert sum(out.num_new_tokens) == out.num_batched_tokens <= self.sc.max_num_batched_tokens
        assert len({id(s) for s in out.seqs}) == len(out.seqs)
        if self.sc.policy == "prefill_first" and out.seqs and not out.is_prefill:
            assert out.num_decodes == len(out.seqs)
            assert all(n == 1 and s.num_computed_tokens == len(s) - 1 and len(s) > s.num_prompt_tokens
                       for s, n in zip(out.seqs, out.num_new_tokens, strict=True)), \
                "prefill_first mixed prefill and decode"
        sampled = self.ex.execute(out)
        for group in self.sched.update(out, sampled):
            self._record(group)
        check_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(20_000):
            if not self.sched.has_unfinished_requests():
                break
            self._one_step()
        else:
            raise AssertionError(f"no progress: {self.sched.stats}")
        assert set(self.finished) == set(self.requests)
        gpu = self.sched.block_manager.gpu
        assert all(r == 0 for r in gpu.ref_counts) and gpu.num_free == gpu.num_blocks
        stats = self.sched.stats
        assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        for rid, group in self.finished.items():
            prompt, sp = self.requests[rid]
            if group.seqs[0].status is SequenceStatus.FINISHED_IGNORED:
                continue
            expected = reference_outputs(prompt, sp, self.limit)
            for seq in group.seqs:
                got = seq.output_token_ids
                if rid in self.aborted:
                    assert got == expected[seq.index][:len(got)]
                else:
                    assert got == expected[seq.index], (rid, seq.index)
            if rid not in self.aborted:
                assert len(group.seqs) == sp.n
                assert all(s.status in (SequenceStatus.FINISHED_STOPPED,
                                        SequenceStatus.FINISHED_LENGTH_CAPPED) for s in group.seqs)
                m = group.metrics
                assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time \
                    <= m.finished_time


COMBOS = list(itertools.product(["prefill_first", "chunked"], ["fcfs", "priority"],
                                 ["recompute", "swap"]))


@pytest.mark.parametrize("hybrid", [False, True], ids=["single_group", "hybrid"])
@pytest.mark.parametrize(("policy", "queue", "mode"), COMBOS)
def test_scheduler_state_machine(policy, queue, mode, hybrid):
    machine = type(f"Machine_{policy}_{queue}_{mode}_{hybrid}", (SchedulerMachine,),
                   {"policy": policy, "queue": queue, "mode": mode, "hybrid": hybrid})
    machine.TestCase.settings = settings(
        max_examples=sized(50, 1000), stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    machine.TestCase().runTest()
