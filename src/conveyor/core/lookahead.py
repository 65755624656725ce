"""Lookahead slots: the scheduler's side of speculative decoding.

After a step's decodes are chosen (each with the slot of its next token), every decoding
sequence may take up to k more *lookahead* slots for proposed tokens (vLLM's
``num_lookahead_slots``): the block manager allocates the blocks those positions need, the
proposer fills ``seq.spec_token_ids`` (a draft model writes its own K/V into those slots of
its cache), slots left unproposed go back at once, and the step's token budget counts the
rest. Nothing is
preempted for a lookahead slot: a sequence proposes fewer tokens when blocks or budget run short.

After verification ``Scheduler.update`` appends the accepted tokens and the next one, and gives
the rejected tokens' slots back (``BlockManager.trim``). Their K/V, written past the accepted
tokens, is never read and is overwritten by later steps; the prefix cache only ever files
blocks of computed, accepted tokens (``num_computed_tokens`` counts nothing else).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.core.sequence import Sequence

if TYPE_CHECKING:
    from conveyor.core.scheduler_interface import SchedulerInterface


def add_lookahead(sched: SchedulerInterface, decodes: list[Sequence], budget: int) -> list[int]:
    """Propose for ``decodes`` and reserve their lookahead slots within ``budget`` extra tokens;
    returns each entry's token count (1 + its proposal's length)."""
    counts = [1] * len(decodes)
    spec = sched.speculative
    if spec is None or budget <= 0 or not spec.enabled_for(len(decodes)):
        return counts
    bm = sched.block_manager
    gpu = bm.gpu
    bs = bm.block_size
    k = spec.num_speculative_tokens
    proposer = sched.proposer
    for i, seq in enumerate(decodes):
        if budget <= 0:
            break
        if not _may_speculate(sched, seq):
            continue
        length = len(seq.token_ids)
        # the step appends up to limit + 1 tokens; max_len ends the sequence
        limit = min(k, budget, seq.max_len - length - 1,
                    (len(seq.block_table) + gpu.num_free) * bs - length)
        if limit <= 0:
            continue
        bm.reserve_slots(seq, length + limit)
        drafts = proposer.propose(seq, limit)
        if len(drafts) < limit:
            bm.trim(seq, length + len(drafts))
        if not drafts:
            continue
        seq.spec_token_ids = drafts
        counts[i] += len(drafts)
        budget -= len(drafts)
    return counts


def _may_speculate(sched: SchedulerInterface, seq: Sequence) -> bool:
    """Decoding, with no per-token logprobs to report (verification samples no logprobs), and
    not under a structured-output grammar (its mask is for the next token only)."""
    params = seq.group.sampling_params
    return (sched.is_decoding(seq) and params.logprobs is None
            and params.structured_outputs is None)


def release_lookahead(sched: SchedulerInterface, seq: Sequence) -> None:
    """Drop ``seq``'s proposal and its lookahead slots (it is preempted before it ran)."""
    if seq.spec_token_ids:
        seq.spec_token_ids = []
        sched.block_manager.trim(seq, len(seq.token_ids))
