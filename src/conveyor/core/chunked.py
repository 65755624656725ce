"""The chunked policy (vLLM v1 / the seeds' ``_schedule_chunked_prefill``): one token budget per
step shared by decodes and prefill chunks, in this order:

1. running decodes (one token each); a sequence that cannot get a slot preempts the most
   recently admitted sequence (mid-prefill ones first), or the lowest-priority one under the
   priority queue, or itself when none is left;
2. swapped sequences resume (when this step preempted nothing);
3. partially prefilled sequences continue, each chunk capped by ``long_prefill_token_threshold``
   (a chunk shrinks to the free blocks; a stuck one preempts later mid-prefill sequences);
4. new requests from the head of ``waiting`` (none while any is swapped out), at most
   ``max_num_partial_prefills`` sequences being left part-way through their prompt; with a KV
   connector, one whose prefix it can load starts loading instead (``core/kv_loading.py``),
   and holds its seat while it loads.

Entries come out in that order, so decodes lead the SchedulerOutput (``num_decodes``).
A sequence with a prefill chunk this step, or swapped in this step, is never a victim (see
``_Step.protected``).
"""

from __future__ import annotations

from conveyor.core.decode import resume_swapped, schedule_decodes
from conveyor.core.lookahead import add_lookahead
from conveyor.core.request_queue import priority_key
from conveyor.core.scheduler_interface import SchedulerInterface
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


class _Step:
    """The step being built."""

    __slots__ = ("seqs", "num_new", "num_decodes", "num_spec", "budget", "protected", "partial")

    def __init__(self, budget: int) -> None:
        self.seqs: list[Sequence] = []
        self.num_new: list[int] = []
        self.num_decodes = 0
        self.num_spec = 0  # lookahead tokens of the decodes
        self.budget = budget
        # never victims this step: sequences with a prefill chunk (the blocks they fill may
        # already be shared through the prefix cache) or swapped in (their blocks are not
        # filled before the step runs)
        self.protected: set[Sequence] = set()
        self.partial: set[Sequence] = set()  # mid-prefill sequences left part-way after the step

    def unschedule_decode(self, seq: Sequence) -> None:
        k = self.seqs.index(seq)
        del self.seqs[k]
        self.budget += self.num_new[k]
        self.num_spec -= self.num_new[k] - 1
        del self.num_new[k]
        self.num_decodes -= 1


def schedule_chunked(sched: SchedulerInterface) -> SchedulerOutput:
    cfg = sched.config
    step = _Step(cfg.max_num_batched_tokens)
    _schedule_decodes(sched, step)
    _continue_prefills(sched, step)
    if not sched.swapped:
        _admit_new(sched, step)
    total = cfg.max_num_batched_tokens - step.budget
    return SchedulerOutput(seqs=step.seqs, num_new_tokens=step.num_new, num_batched_tokens=total,
                           is_prefill=bool(step.seqs) and step.num_decodes == 0,
                           num_decodes=step.num_decodes, num_spec_tokens=step.num_spec)


# ---------------------------------------------------------------------- 1. decodes, 2. swapped

def _schedule_decodes(sched: SchedulerInterface, step: _Step) -> None:
    limit = min(sched.config.max_num_seqs, step.budget)
    decodes = schedule_decodes(sched, limit)
    step.protected.update(resume_swapped(sched, decodes, limit))
    n = len(decodes)
    step.seqs = decodes
    step.num_new = add_lookahead(sched, decodes, step.budget - n)
    step.num_decodes = n
    step.num_spec = sum(step.num_new) - n
    step.budget -= n + step.num_spec


# ---------------------------------------------------------------------- 3. partial prefills

def _chunk_size(sched: SchedulerInterface, remaining: int, budget: int) -> int:
    chunk = remaining if remaining < budget else budget
    cap = sched.config.long_prefill_token_threshold
    if cap and chunk > cap:
        chunk = cap
    return chunk


def _continue_prefills(sched: SchedulerInterface, step: _Step) -> None:
    """Schedule chunks of mid-prefill sequences (``step.partial``: those left part-way)."""
    bm = sched.block_manager
    max_seqs = sched.config.max_num_seqs
    windows = bool(bm.window_groups)
    for seq in list(sched.prefilling):
        if seq.status is not RUNNING:
            continue
        if step.budget <= 0 or len(step.seqs) >= max_seqs:
            step.partial.add(seq)
            continue
        computed = seq.num_computed_tokens
        remaining = len(seq.token_ids) - computed
        chunk = _chunk_size(sched, remaining, step.budget)
        if windows:
            bm.release_skipped(seq)
        while True:
            fit = bm.slot_capacity(seq) - computed
            if fit >= chunk:
                break
            victim = _prefill_victim(sched, seq, step)
            if victim is None:
                chunk = fit if fit > 0 else 0
                break
            _preempt(sched, step, victim)
        if chunk <= 0:
            step.partial.add(seq)
            continue
        bm.grow(seq, computed + chunk)
        step.seqs.append(seq)
        step.num_new.append(chunk)
        step.budget -= chunk
        step.protected.add(seq)
        if chunk < remaining:
            step.partial.add(seq)


def _prefill_victim(sched: SchedulerInterface, seq: Sequence, step: _Step) -> Sequence | None:
    """Who makes room for a stuck prefill: a later mid-prefill sequence (fcfs), or under the
    priority queue any unchunked sequence ranking below ``seq``."""
    prefilling = sched.prefilling
    if not sched.priority_queue:
        last = prefilling[-1] if prefilling else None
        return last if last is not None and last is not seq and last not in step.protected else None
    candidates = [s for s in prefilling + sched.running if s not in step.protected and s is not seq]
    victim = sched.lowest_priority(candidates)
    if victim is None or priority_key(victim) <= priority_key(seq):
        return None
    return victim


def _preempt(sched: SchedulerInterface, step: _Step, victim: Sequence) -> None:
    step.partial.discard(victim)
    if victim in sched.prefilling:
        sched.prefilling.remove(victim)
    else:
        if victim in step.seqs:
            step.unschedule_decode(victim)
        sched.running.remove(victim)  # now: it may rejoin running before the next step
    sched.preempt(victim)


# ---------------------------------------------------------------------- 4. new requests

def _admit_new(sched: SchedulerInterface, step: _Step) -> None:
    """Admit from the head of ``waiting``; under the priority queue a head may preempt
    strictly lower-priority sequences for a partial-prefill slot, a seat or blocks."""
    bm = sched.block_manager
    gpu = bm.gpu
    bs = bm.block_size
    cfg = sched.config
    max_seqs = cfg.max_num_seqs
    windows = bool(bm.window_groups)
    waiting = sched.waiting
    now = None
    retry = False  # the head just preempted lower-priority sequences: try it again
    loras = sched.lora_admission()
    while step.budget > 0 and len(step.seqs) < max_seqs:
        if sched.swapped and not retry:  # victims swapped out for a head resume before others
            break
        seq = sched.next_waiting(loras)
        if seq is None:
            break
        hits = bm.find_cached_prefix(seq)
        group = seq.group
        seats = group.sampling_params.n if len(group.seqs) == 1 else 1
        num_running = len(sched.running) + len(sched.prefilling) + len(sched.loading)
        if (sched.kv_connector is not None and num_running + seats <= max_seqs
                and sched.start_load(seq, hits)):
            continue
        cached = len(hits[0]) * bs
        num_tokens = len(seq.token_ids)
        chunk = _chunk_size(sched, num_tokens - cached, step.budget)
        if windows:  # a chunk whose blocks exceed the whole cache would wait forever
            chunk = min(chunk, bm.chunk_limit(cached))
        partial = cached + chunk < num_tokens
        blocked_by = None
        if partial and len(step.partial) >= cfg.max_num_partial_prefills:
            blocked_by = step.partial
        elif num_running and num_running + seats > max_seqs:
            blocked_by = sched.prefilling + sched.running
        elif bm.num_new_blocks_to_admit(hits, cached + chunk) > gpu.num_free:
            blocked_by = sched.prefilling + sched.running
        if blocked_by is not None:
            retry = sched.priority_queue and _preempt_lower_priority(sched, step, seq, blocked_by)
            if retry:
                continue
            break
        retry = False
        waiting.take(seq)
        if now is None:
            now = sched.clock()
        sched.admit(seq, hits, cached + chunk, now)
        sched.prefilling.append(seq)
        if loras is not None:
            loras.admitted(seq)
        step.seqs.append(seq)
        step.num_new.append(chunk)
        step.budget -= chunk
        step.protected.add(seq)
        if partial:
            step.partial.add(seq)


def _preempt_lower_priority(sched: SchedulerInterface, step: _Step, head: Sequence,
                            among: set[Sequence] | list[Sequence]) -> bool:
    """Preempt the lowest-priority of ``among`` if it ranks strictly below ``head``."""
    candidates = [s for s in among if s not in step.protected]
    victim = sched.lowest_priority(candidates)
    if victim is None or victim.group.priority <= head.group.priority:
        return False
    _preempt(sched, step, victim)
    return True
