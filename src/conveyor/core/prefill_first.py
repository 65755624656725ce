"""The prefill_first policy (nano-vllm's ``schedule()``, the seeds' worked example).

A step is all-prefill or all-decode:

* prefill: admit from the head of ``waiting`` while the step has fewer than ``max_num_seqs``
  sequences, its *uncached* prompt tokens stay within ``max_num_batched_tokens`` and the blocks
  can be allocated; stop at the first request that does not fit (no skipping, except past
  requests whose LoRA adapter may not start yet: ``core/lora_admission.py``). Under the
  priority queue, a head that lacks blocks may preempt strictly lower-priority running ones.
  With a KV connector, a head whose prefix it can load starts loading instead (taking one of
  the step's seats) and the next one is considered (``core/kv_loading.py``).
  Nothing is admitted while sequences are swapped out (they resume first).
* decode: take ``running`` in order; a sequence that cannot get a slot preempts the *last*
  running sequence (fcfs) or the lowest-priority one (priority) and retries, or preempts itself
  when no other is left. Scheduled sequences keep their order at the front of ``running``.
  Swapped sequences resume (swap in) when the step preempted nothing.
"""

from __future__ import annotations

from conveyor.core.decode import resume_swapped, schedule_decodes
from conveyor.core.lookahead import add_lookahead
from conveyor.core.scheduler_interface import SchedulerInterface
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence


def schedule_prefill_first(sched: SchedulerInterface) -> SchedulerOutput:
    if sched.waiting and not sched.swapped:
        out = _prefill_step(sched)
        if out is not None:
            return out
    return _decode_step(sched)


def _prefill_step(sched: SchedulerInterface) -> SchedulerOutput | None:
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
    loras = sched.lora_admission()
    loads = 0  # sequences that started loading their prefix this step: they take seats too
    while len(seqs) + loads < max_seqs:
        if sched.swapped:  # a victim of this step's priority preemption: it resumes first
            break
        seq = sched.next_waiting(loras)
        if seq is None:
            break
        hits = bm.find_cached_prefix(seq)
        if sched.kv_connector is not None and sched.start_load(seq, hits):
            loads += 1
            continue
        num_tokens = len(seq.token_ids)
        uncached = num_tokens - len(hits[0]) * block_size
        if total + uncached > budget:
            break
        fits = bm.num_new_blocks_to_admit(hits, num_tokens) <= gpu.num_free
        while not fits and sched.priority_queue and _preempt_lower_priority(sched, seq):
            hits = bm.find_cached_prefix(seq)  # blocks were freed: look the head up again
            fits = bm.num_new_blocks_to_admit(hits, num_tokens) <= gpu.num_free
        if not fits:
            break
        uncached = num_tokens - len(hits[0]) * block_size
        waiting.take(seq)
        sched.admit(seq, hits, num_tokens, now)
        sched.join_running(seq)
        if loras is not None:
            loras.admitted(seq)
        seqs.append(seq)
        num_new.append(uncached)
        total += uncached
    if not seqs:
        return None
    return SchedulerOutput(seqs=seqs, num_new_tokens=num_new, num_batched_tokens=total,
                           is_prefill=True)


def _preempt_lower_priority(sched: SchedulerInterface, head: Sequence) -> bool:
    """Preempt the lowest-priority running sequence if it ranks strictly below ``head``."""
    victim = sched.lowest_priority(sched.running)
    if victim is None or victim.group.priority <= head.group.priority:
        return False
    sched.running.remove(victim)
    sched.preempt(victim)
    return True


def _decode_step(sched: SchedulerInterface) -> SchedulerOutput:
    limit = sched.config.max_num_seqs
    scheduled = schedule_decodes(sched, limit)
    resume_swapped(sched, scheduled, limit)
    n = len(scheduled)
    counts = add_lookahead(sched, scheduled, sched.config.max_num_batched_tokens - n)
    total = sum(counts)
    return SchedulerOutput(seqs=scheduled, num_new_tokens=counts, num_batched_tokens=total,
                           is_prefill=False, num_decodes=n, num_spec_tokens=total - n)
