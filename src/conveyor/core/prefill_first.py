"""The prefill_first policy (nano-vllm's ``schedule()``, the seeds' worked example).

A step is all-prefill or all-decode:

* prefill: admit from the head of ``waiting`` while the step has fewer than ``max_num_seqs``
  sequences, its *uncached* prompt tokens stay within ``max_num_batched_tokens`` and the blocks
  can be allocated; stop at the first request that does not fit (no skipping). Under the
  priority queue, a head that lacks blocks may preempt strictly lower-priority running ones.
  Nothing is admitted while sequences are swapped out (they resume first).
* decode: take ``running`` in order; a sequence that cannot get a slot preempts the *last*
  running sequence (fcfs) or the lowest-priority one (priority) and retries, or preempts itself
  when no other is left. Scheduled sequences keep their order at the front of ``running``.
  Swapped sequences resume (swap in) when the step preempted nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from conveyor.core.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING


def schedule_prefill_first(sched: Scheduler) -> SchedulerOutput:
    if sched.waiting and not sched.swapped:
        out = _prefill_step(sched)
        if out is not None:
            return out
    return _decode_step(sched)


def _prefill_step(sched: Scheduler) -> SchedulerOutput | None:
    bm = sched.block_manager
    gpu = bm.gpu
    waiting = sched.waiting
    max_seqs = sched.config.max_num_seqs
    budget = sched.config.max_num_batched_tokens
    block_size = bm.block_size
    seqs: list[Sequence] = []
    num_new: list[int] = []
    total = 0
    now = sched.clock()
    while len(seqs) < max_seqs:
        if sched.swapped:  # a victim of this step's priority preemption: it resumes first
            break
        seq = waiting.peek()
        if seq is None:
            break
        hits = bm.find_cached_prefix(seq)
        num_tokens = len(seq.token_ids)
        uncached = num_tokens - len(hits) * block_size
        if total + uncached > budget:
            break
        fits = bm.num_new_blocks_to_admit(hits, num_tokens) <= gpu.num_free
        while not fits and sched.priority_queue and _preempt_lower_priority(sched, seq):
            hits = bm.find_cached_prefix(seq)  # blocks were freed: look the head up again
            fits = bm.num_new_blocks_to_admit(hits, num_tokens) <= gpu.num_free
        if not fits:
            break
        uncached = num_tokens - len(hits) * block_size
        waiting.pop()
        sched.admit(seq, hits, num_tokens, now)
        sched.join_running(seq)
        seqs.append(seq)
        num_new.append(uncached)
        total += uncached
    if not seqs:
        return None
    return SchedulerOutput(seqs=seqs, num_new_tokens=num_new, num_batched_tokens=total,
                           is_prefill=True)


def _preempt_lower_priority(sched: Scheduler, head: Sequence) -> bool:
    """Preempt the lowest-priority running sequence if it ranks strictly below ``head``."""
    victim = sched.lowest_priority(sched.running)
    if victim is None or victim.group.priority <= head.group.priority:
        return False
    sched.running.remove(victim)
    sched.preempt(victim)
    return True


def _decode_step(sched: Scheduler) -> SchedulerOutput:
    scheduled = decodes_without_preemption(sched, sched.config.max_num_seqs)
    if scheduled is None:
        scheduled = _decode_with_preemption(sched)
    if sched.swapped and not sched.preempted_this_step:
        _swap_in(sched, scheduled)
    n = len(scheduled)
    return SchedulerOutput(seqs=scheduled, num_new_tokens=[1] * n, num_batched_tokens=n,
                           is_prefill=False, num_decodes=n)


def decodes_without_preemption(sched: Scheduler, limit: int) -> list[Sequence] | None:
    """The first ``limit`` running sequences, when their new blocks are all free (else None).

    Only sequences at a block boundary (or sharing a block after a fork) touch the block
    manager; ``running`` is sorted by join stamp, so the cut needs no scan.
    """
    bm = sched.block_manager
    running = sched.running
    needs = sched.needs
    if len(running) <= limit:
        if len(needs) > bm.gpu.num_free:
            return None
        todo, later = needs, []
    else:
        cut = running[limit - 1].running_stamp
        todo = [s for s in needs if s.running_stamp <= cut]
        if len(todo) > bm.gpu.num_free:
            return None
        later = [s for s in needs if s.running_stamp > cut]
    if todo:
        set_next_event = sched.set_next_event
        for seq in todo:
            if seq.status is RUNNING:
                bm.append_slot(seq)
                set_next_event(seq)
    sched.needs = later
    return running[:limit]


def _decode_with_preemption(sched: Scheduler) -> list[Sequence]:
    """The seeds' decode loop, exactly: LIFO (or lowest-priority) victims, self last."""
    bm = sched.block_manager
    gpu = bm.gpu
    running = sched.running
    max_seqs = sched.config.max_num_seqs
    priority = sched.priority_queue
    scheduled: list[Sequence] = []
    i = 0
    end = len(running)
    while i < end and len(scheduled) < max_seqs:
        seq = running[i]
        i += 1
        if seq.status is not RUNNING:  # a victim taken earlier in this loop
            continue
        if len(seq.token_ids) < seq.next_event:  # its slot is ready: no block needed
            scheduled.append(seq)
            continue
        while gpu.num_free == 0 and bm.slot_needs_block(seq):
            victim = None
            if priority:
                candidates = scheduled + [seq] + running[i:end]
                victim = sched.lowest_priority(candidates)
                if victim is seq:
                    victim = None
                elif victim is not None and victim in scheduled:
                    scheduled.remove(victim)
            else:
                while end > i:
                    end -= 1
                    if running[end].status is RUNNING:
                        victim = running[end]
                        break
            if victim is None:
                sched.preempt(seq)
                break
            sched.preempt(victim)
        else:
            bm.append_slot(seq)
            sched.set_next_event(seq)
            scheduled.append(seq)
    rest = [s for s in running[i:] if s.status is RUNNING]
    sched.running = scheduled + rest
    sched.needs = [s for s in rest if len(s.token_ids) >= s.next_event]
    return scheduled[:]


def _swap_in(sched: Scheduler, scheduled: list[Sequence]) -> None:
    """Resume swapped sequences (head first) while seats and blocks allow."""
    max_seqs = sched.config.max_num_seqs
    gpu = sched.block_manager.gpu
    swapped = sched.swapped
    while len(scheduled) < max_seqs:
        seq = swapped.peek()
        if seq is None or sched.blocks_to_swap_in(seq) > gpu.num_free:
            break
        swapped.pop()
        sched.swap_in(seq)
        sched.join_running(seq)
        scheduled.append(seq)
