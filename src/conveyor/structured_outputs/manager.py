"""StructuredOutputManager: the grammar side of constrained requests, beside the scheduler.

Per request: the future of its compiled grammar (``GrammarCompileCache``), held until the
request is removed. Per sequence: an
xgrammar ``GrammarMatcher`` and how many of the sequence's output tokens it has accepted.

The matcher follows the sequence, not the other way round: before each use it is synced to the
sequence's output tokens (``_sync``), replaying the tokens it has not seen and rolling back the
ones the sequence no longer has. So a forked sample (n > 1) gets its own matcher that replays
its first token, and a sequence preempted by recompute or swap (which keeps its tokens) finds
its matcher where it left it; nothing in the scheduler has to tell the grammar about either.
A constraint with ``reasoning_end`` token ids applies to the answer after a reasoning model's
thinking: it starts after their first occurrence in the output, and until then the sequence
samples unconstrained. With ``reasoning_start`` too, the reply thinks only if it opens with
those tokens: while it may still open, the grammar follows it and the marker's next token is
allowed beside the grammar's; a reply that does not open them is constrained from its start.

Per step: ``bitmask()`` fills one row of xgrammar's packed token bitmask per constrained
sequence that samples (``ModelRunner.sample`` calls it before sampling, and the sampler applies
it to its logits; the engine hands the manager to the executor once,
``ModelExecutor.use_structured_outputs``); after ``Scheduler.update``, ``LLMEngine.step`` calls
``advance()``, which feeds the sampled tokens to the matchers and names the sequences whose
grammar has ended.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceGroup
from conveyor.structured_outputs.compiler import GrammarCompileCache


@dataclass
class GrammarBitmask:
    """The tokens each constrained sequence of a step may sample next.

    ``bitmask[row_of[seq_id]]`` is xgrammar's packed row (bit ``t % 32`` of word ``t // 32``
    set when token ``t`` is allowed); sequences without a row are unconstrained.
    """

    bitmask: torch.Tensor  # int32 [rows, ceil(vocab / 32)]
    row_of: dict[int, int] = field(default_factory=dict)  # Sequence.seq_id -> row


@dataclass
class _SeqGrammar:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0
    rejected: bool = False  # a token the grammar does not allow reached the sequence
    start: int | None = 0  # output tokens before the grammar's first; None: still reasoning
    searched: int = 0  # output tokens searched for the end of the reasoning
    opening: int | None = None  # the reasoning_start token that may come next, if any

    @property
    def ended(self) -> bool:
        """The grammar has ended, or cannot follow a reply that is not opening reasoning."""
        return self.opening is None and (self.rejected or self.matcher.is_terminated())


class StructuredOutputManager:
    def __init__(self, compile_cache: GrammarCompileCache, vocab_size: int) -> None:
        self.compile_cache = compile_cache
        self.vocab_size = vocab_size
        self._futures: dict[str, Future[xgr.CompiledGrammar]] = {}  # compiling, by request id
        self._held: dict[str, Future[xgr.CompiledGrammar]] = {}  # cache entries held
        self._grammars: dict[str, xgr.CompiledGrammar] = {}  # compiled, by request id
        self._seqs: dict[int, _SeqGrammar] = {}  # by Sequence.seq_id
        self._seq_ids: dict[str, list[int]] = {}  # request id -> its matchers' seq ids
        self._batch = xgr.BatchGrammarMatcher()
        self.mask_seconds = 0.0  # time spent filling bitmasks (``--profile``)
        self.num_masked_rows = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, group: SequenceGroup) -> None:
        """Start compiling ``group``'s constraint (at once ready when it is cached)."""
        future = self.compile_cache.submit(group.sampling_params.structured_outputs)
        self._futures[group.request_id] = self._held[group.request_id] = future

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._grammars

    def has_pending(self) -> bool:
        return bool(self._futures)

    def poll(self, wait_s: float = 0.0) -> tuple[list[str], list[tuple[str, str]]]:
        """(request ids whose grammar is ready, (request id, error) of failed compiles).
        ``wait_s`` > 0: wait that long for the first one when none is done yet."""
        if not self._futures:
            return [], []
        if wait_s > 0 and not any(f.done() for f in self._futures.values()):
            from concurrent.futures import FIRST_COMPLETED, wait

            wait(list(self._futures.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for request_id, future in list(self._futures.items()):
            if not future.done():
                continue
            del self._futures[request_id]
            error = "the compile was cancelled" if future.cancelled() else future.exception()
            if error is None:
                self._grammars[request_id] = future.result()
                ready.append(request_id)
            else:
                failed.append((request_id, str(error)))
        return ready, failed

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request (its compile, if still running and wanted by
        no other request, is cancelled)."""
        self._futures.pop(request_id, None)
        held = self._held.pop(request_id, None)
        if held is not None:
            self.compile_cache.release(held)
        self._grammars.pop(request_id, None)
        for seq_id in self._seq_ids.pop(request_id, ()):
            self._seqs.pop(seq_id, None)

    # ------------------------------------------------------------------ per step

    def bitmask(self, scheduled: SchedulerOutput) -> GrammarBitmask | None:
        """One bitmask row per constrained sequence that samples this step (None if none)."""
        if not self._grammars:
            return None
        seqs = [seq for i, seq in enumerate(scheduled.seqs)
                if seq.group.request_id in self._grammars and scheduled.num_samples(i) > 0]
        if not seqs:
            return None
        start = time.perf_counter()
        states = [(seq, self._sync(seq)) for seq in seqs]
        states = [(seq, state) for seq, state in states if state.start is not None]
        if not states:  # all still reasoning
            return None
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # all allowed
        row_of, matchers, rows = {}, [], []
        for row, (seq, state) in enumerate(states):
            row_of[seq.seq_id] = row
            if not (state.matcher.is_terminated() or state.rejected):  # else: it is finishing
                matchers.append(state.matcher)
                rows.append(row)
            elif state.opening is not None:  # only the reasoning marker can go on
                bitmask[row] = 0
        if len(matchers) > 1:  # xgrammar's threads fill the rows in parallel
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        elif matchers:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        for row, (_, state) in enumerate(states):
            if state.opening is not None:
                word, bit = divmod(state.opening, 32)
                value = int(bitmask[row, word]) | 1 << bit
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32
        self.mask_seconds += time.perf_counter() - start
        self.num_masked_rows += len(states)
        return GrammarBitmask(bitmask, row_of)

    def advance(self, seqs: list[Sequence]) -> list[Sequence]:
        """Feed the newly sampled tokens of ``seqs`` (and of samples forked from them) to their
        matchers; the unfinished sequences whose grammar has ended (or that hold a token the
        grammar rejects) — they must stop."""
        ended = []
        for parent in seqs:
            group = parent.group
            if group.request_id not in self._grammars:
                continue
            family = group.seqs if len(group.seqs) > 1 else (parent,)
            for seq in family:
                if seq.status.is_finished:
                    continue
                if self._sync(seq).ended:
                    ended.append(seq)
        return ended

    # ------------------------------------------------------------------ matchers

    def _sync(self, seq: Sequence) -> _SeqGrammar:
        """``seq``'s matcher, having accepted exactly its output tokens (those after the end
        of its reasoning when its constraint waits for one)."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            grammar = self._grammars[seq.group.request_id]
            state = self._seqs[seq.seq_id] = _SeqGrammar(xgr.GrammarMatcher(grammar))
            self._seq_ids.setdefault(seq.group.request_id, []).append(seq.seq_id)
        num_outputs = len(seq.token_ids) - seq.num_prompt_tokens
        start = self._grammar_start(seq, state, num_outputs)
        if start != state.start:  # reasoning has begun, ended, or been taken back
            state.matcher.reset()
            state.start, state.num_accepted, state.rejected = start, 0, False
        if start is None:
            return state
        num_grammar = num_outputs - start
        if state.num_accepted > num_grammar:
            state.matcher.rollback(state.num_accepted - num_grammar)
            state.num_accepted = num_grammar
            state.rejected = False
        while state.num_accepted < num_grammar and not state.rejected:
            token = seq.token_ids[seq.num_prompt_tokens + start + state.num_accepted]
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                state.rejected = True
                break
            state.num_accepted += 1
        return state

    @staticmethod
    def _grammar_start(seq: Sequence, state: _SeqGrammar, num_outputs: int) -> int | None:
        """How many output tokens precede the grammar's first: 0 without reasoning, the end of
        the first ``reasoning_end`` marker after it, None while the reply reasons. Sets
        ``state.opening``; searches only the tokens earlier calls have not."""
        constraint = seq.group.sampling_params.structured_outputs
        start, end = constraint.reasoning_start, constraint.reasoning_end
        state.opening = None
        if not end:
            return 0
        first = seq.num_prompt_tokens
        tokens = seq.token_ids
        if start:
            head = tuple(tokens[first:first + len(start)])
            if head != start[:len(head)]:
                return 0  # the reply does not open reasoning
            if len(head) < len(start):
                state.opening = start[len(head)]  # it may still open reasoning
                return 0
        if state.start and state.start <= num_outputs:
            return state.start  # the end marker found earlier is still there
        state.searched = max(len(start), min(state.searched, num_outputs) - len(end) + 1)
        for at in range(first + state.searched, len(tokens) - len(end) + 1):
            if tuple(tokens[at:at + len(end)]) == end:
                return at + len(end) - first
        state.searched = num_outputs
        return None
