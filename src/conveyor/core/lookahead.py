"""Lookahead slots: the scheduler's side of speculative decoding.

After each step the executor proposes tokens to continue each sequence that sampled
(``Scheduler.update_draft_token_ids`` stores them as ``seq.draft_token_ids``). When the next
step's decodes are chosen (each with the slot of its next token), every decoding sequence may
take up to k more *lookahead* slots for its proposal (vLLM's ``num_lookahead_slots``): the
block manager allocates the blocks those positions need, the proposal becomes
``seq.spec_token_ids``, and the step's token budget counts it. A draft model also needs slots
for the K/V of its next proposal, computed after this step: up to k more
(``SpeculativeConfig.drafting_slots``), which the budget does not count. Nothing is preempted for
a lookahead slot: a sequence verifies fewer tokens when blocks or budget run short.

After verification ``Scheduler.update`` appends the accepted tokens and the next one, and gives
the slots past them back (``BlockManager.trim``). Their K/V, written past the accepted tokens,
is never read and is overwritten by later steps; the prefix cache only ever files blocks of
computed, accepted tokens (``num_computed_tokens`` counts nothing else).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.core.sequence import Sequence

if TYPE_CHECKING:
    from conveyor.core.scheduler_interface import SchedulerInterface


def add_lookahead(sched: SchedulerInterface, decodes: list[Sequence], budget: int) -> list[int]:
    """Take ``decodes``' proposals and reserve their lookahead slots within ``budget`` extra
    tokens; returns each entry's token count (1 + the length of the proposal it verifies)."""
    counts = [1] * len(decodes)
    spec = sched.speculative
    if spec is None or not spec.enabled_for(len(decodes)):
        return counts
    bm = sched.block_manager
    k = spec.num_speculative_tokens
    for i, seq in enumerate(decodes):
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if not (sched.is_decoding(seq) and may_speculate(seq)):
            continue
        length = len(seq.token_ids)
        room = bm.slot_capacity(seq) - length
        # the step appends up to limit + 1 tokens; max_len ends the sequence
        limit = max(0, min(k, budget, seq.max_len - length - 1, room, len(drafts)))
        drafting = min(spec.drafting_slots, room - limit)
        if limit + drafting > 0:
            bm.reserve_slots(seq, length + limit + drafting)
        if not limit:
            continue
        seq.spec_token_ids = drafts[:limit]
        counts[i] += limit
        budget -= limit
    return counts


def may_speculate(seq: Sequence) -> bool:
    """Whether ``seq`` may verify proposals (and so whether proposing for it is worth it): no
    per-token logprobs to report (verification samples no logprobs), no structured-output
    grammar (its mask is for the next token only), not a pooling request."""
    group = seq.group
    params = group.sampling_params
    return (params.logprobs is None and params.structured_outputs is None
            and group.pooling_params is None)


def release_lookahead(sched: SchedulerInterface, seq: Sequence) -> None:
    """Drop ``seq``'s proposal and its lookahead slots (it is preempted before it ran)."""
    if sched.speculative is not None:
        seq.spec_token_ids = []
        sched.block_manager.trim(seq, len(seq.token_ids))
