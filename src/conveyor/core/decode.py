"""The decode phase both policies share: running sequences get one token each (preempting when
blocks run out), then swapped sequences resume.

A sequence that cannot get a slot for its next token preempts, in this order of preference:
under the priority queue the lowest-priority sequence among the scheduled, the not yet visited
and the mid-prefill ones (itself included: then it preempts itself); otherwise the newest
mid-prefill sequence, else the last running one (LIFO), else itself. Only ``chunked`` has
mid-prefill sequences (``prefilling``); for ``prefill_first`` this is the seeds' decode loop.
"""

from __future__ import annotations

from conveyor.core.scheduler_interface import SchedulerInterface
from conveyor.core.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


def schedule_decodes(sched: SchedulerInterface, limit: int) -> list[Sequence]:
    """Up to ``limit`` running sequences, in ``running`` order, each with a slot for one token.

    Scheduled sequences keep their order at the front of ``running``. The returned list is the
    caller's to extend (``resume_swapped``).
    """
    scheduled = _decodes_without_preemption(sched, limit)
    if scheduled is None:
        scheduled = _decodes_with_preemption(sched, limit)
    return scheduled


def _decodes_without_preemption(sched: SchedulerInterface, limit: int) -> list[Sequence] | None:
    """The first ``limit`` running sequences, when their new blocks are all free (else None).

    Only sequences at a block boundary (or sharing a block after a fork) touch the block
    manager; ``running`` is sorted by join stamp, so the cut needs no scan.
    """
    bm = sched.block_manager
    running = sched.running
    needing = sched.seqs_needing_block
    per_seq = bm.num_groups  # a boundary takes a block in every group (a bound for windows)
    if len(running) <= limit:
        if len(needing) * per_seq > bm.gpu.num_free:
            return None
        this_step, later = needing, []
    else:
        cut = running[limit - 1].running_stamp
        this_step = [s for s in needing if s.running_stamp <= cut]
        if len(this_step) * per_seq > bm.gpu.num_free:
            return None
        later = [s for s in needing if s.running_stamp > cut]
    if this_step:
        set_next_check_len = sched.set_next_check_len
        for seq in this_step:
            if seq.status is RUNNING:
                bm.append_slot(seq)
                set_next_check_len(seq)
    sched.seqs_needing_block = later
    return running[:limit]


def _decodes_with_preemption(sched: SchedulerInterface, limit: int) -> list[Sequence]:
    bm = sched.block_manager
    gpu = bm.gpu
    num_groups = bm.num_groups
    windows = bool(bm.window_groups)
    running = sched.running
    prefilling = sched.prefilling
    priority = sched.priority_queue
    scheduled: list[Sequence] = []
    i = 0
    end = len(running)
    while i < end and len(scheduled) < limit:
        seq = running[i]
        i += 1
        if seq.status is not RUNNING:  # a victim taken earlier in this loop
            continue
        if len(seq.token_ids) < seq.next_check_len:  # its slot is ready: no block needed
            scheduled.append(seq)
            continue
        if windows:
            bm.release_skipped(seq)
        while gpu.num_free < num_groups and bm.blocks_for_slot(seq) > gpu.num_free:
            victim = None
            if priority:
                victim = sched.lowest_priority(scheduled + [seq] + running[i:end] + prefilling)
                if victim is seq:
                    victim = None
                elif victim in scheduled:
                    scheduled.remove(victim)
            elif prefilling:
                victim = prefilling[-1]
            else:
                while end > i:
                    end -= 1
                    if running[end].status is RUNNING:
                        victim = running[end]
                        break
            if victim is None:
                sched.preempt(seq)
                break
            if victim in prefilling:
                prefilling.remove(victim)
            sched.preempt(victim)
        else:
            bm.append_slot(seq)
            sched.set_next_check_len(seq)
            scheduled.append(seq)
    rest = [s for s in running[i:] if s.status is RUNNING]
    sched.running = scheduled + rest
    sched.seqs_needing_block = [s for s in rest if len(s.token_ids) >= s.next_check_len]
    return scheduled[:]


def resume_swapped(sched: SchedulerInterface, scheduled: list[Sequence],
                   limit: int) -> list[Sequence]:
    """Swap sequences in from the head of ``swapped`` while ``scheduled`` has fewer than
    ``limit`` entries and their blocks are free; returns those swapped in. Nothing resumes in a
    step that had to preempt: memory is short, and swapping back in would only thrash.

    A decoding one joins ``running`` and ``scheduled`` (one token); one that was preempted
    mid-prefill (chunked only) joins ``prefilling`` and takes no seat here.
    """
    swapped = sched.swapped
    resumed: list[Sequence] = []
    if not swapped or sched.preempted_this_step:
        return resumed
    gpu = sched.block_manager.gpu
    while len(scheduled) < limit:
        seq = swapped.peek()
        if seq is None or sched.blocks_to_swap_in(seq) > gpu.num_free:
            break
        swapped.pop()
        decoding = sched.is_decoding(seq)
        sched.swap_in(seq)
        resumed.append(seq)
        if decoding:
            sched.join_running(seq)
            scheduled.append(seq)
        else:
            sched.prefilling.append(seq)
    return resumed
