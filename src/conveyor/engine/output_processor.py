"""OutputProcessor: turns the scheduler's token ids into RequestOutputs.

It owns everything the engine adds on top of raw tokens, per sequence: incremental
detokenization, stop strings (which end a sequence through a callback into the scheduler),
logprobs, and the finished-by-reason counters. The scheduler's SequenceGroup stays the
source of truth for token ids, statuses and metrics.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.sampling_params import RequestOutputKind
from conveyor.core.sequence import Sequence, SequenceGroup, SequenceStatus
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.outputs import CompletionOutput, Logprob, RequestOutput
from conveyor.engine.stop_strings import find_stop_string, partial_stop_len, truncate_at_stop

FinishSequence = Callable[[Sequence, SequenceStatus, str], None]


@dataclass
class _SeqState:
    detokenizer: IncrementalDetokenizer
    num_processed: int = 0  # output tokens already detokenized
    text: str = ""
    done: bool = False  # final text settled (flushed or cut at a stop string)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0  # output tokens, and characters of text, already in a DELTA output
    sent_chars: int = 0


@dataclass
class _RequestState:
    group: SequenceGroup
    prompt: str | None
    seqs: dict[int, _SeqState] = field(default_factory=dict)  # by Sequence.index
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any, finish_sequence: FinishSequence, clock: Callable[[], float]):
        self._tokenizer = tokenizer
        self._finish_sequence = finish_sequence
        self._clock = clock
        self._requests: dict[str, _RequestState] = {}
        self._token_text: dict[int, str] = {}
        self.finished_by_reason: Counter[str] = Counter()  # per finished sequence

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, group: SequenceGroup, prompt: str | None) -> None:
        state = self._requests[group.request_id] = _RequestState(group, prompt)
        if group.sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first token has no context to score it

    def add_prompt_logprobs(self, seq: Sequence, first: int,
                            entries: list[dict[int, tuple[float, int]]]) -> None:
        """Record the logprobs of prompt tokens ``first, first + 1, ...``; positions already
        recorded (recomputed after a preemption) are kept as they were."""
        request = self._requests.get(seq.group.request_id)
        if request is None or request.prompt_logprobs is None:
            return
        scored = request.prompt_logprobs
        for k, entry in enumerate(entries):
            if first + k == len(scored):
                scored.append({t: Logprob(lp, self._text_of(t), rank)
                               for t, (lp, rank) in entry.items()})

    def add_embedding(self, seq: Sequence, vector: list[float]) -> None:
        """Record a pooling request's vector (called before ``process``)."""
        request = self._requests.get(seq.group.request_id)
        if request is not None:
            request.embedding = vector

    def add_logprobs(self, seq: Sequence, token_id: int, logprobs: dict[int, float]) -> None:
        """Record the logprobs of ``seq``'s newest token (called before ``process``)."""
        request = self._requests.get(seq.group.request_id)
        if request is None or seq.group.sampling_params.logprobs is None:
            return
        state = self._state(request, seq)
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.append({tid: Logprob(lp, self._text_of(tid)) for tid, lp in logprobs.items()})
        state.cumulative_logprob += logprobs.get(token_id, 0.0)

    def process(self, groups: Iterable[SequenceGroup]) -> list[RequestOutput]:
        """Detokenize new tokens of ``groups``; one output per request with news, in order."""
        outputs, seen = [], set()
        for group in groups:
            request = self._requests.get(group.request_id)
            if request is None or group.request_id in seen:
                continue
            seen.add(group.request_id)
            progressed = False
            for seq in group.seqs:
                progressed |= self._update_seq(request, seq)
            final_only = group.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
            if group.is_finished or (progressed and not final_only):
                outputs.append(self._make_output(request))
        return outputs

    def finish_aborted(self, group: SequenceGroup) -> RequestOutput | None:
        request = self._requests.get(group.request_id)
        if request is None:
            return None
        for seq in group.seqs:
            self._update_seq(request, seq)
        return self._make_output(request)

    # ------------------------------------------------------------------ internals

    def _state(self, request: _RequestState, seq: Sequence) -> _SeqState:
        state = request.seqs.get(seq.index)
        if state is None:
            params = request.group.sampling_params
            detok = IncrementalDetokenizer(self._tokenizer, request.group.prompt_token_ids,
                                           params.skip_special_tokens)
            state = request.seqs[seq.index] = _SeqState(detok)
        return state

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id])
        return text

    def _update_seq(self, request: _RequestState, seq: Sequence) -> bool:
        """Detokenize ``seq``'s new tokens and look for stop strings; True if it has new tokens."""
        state = self._state(request, seq)
        params = request.group.sampling_params
        output_ids = seq.output_token_ids
        new = len(output_ids) - state.num_processed
        while not state.done and state.num_processed < len(output_ids):
            token_id = output_ids[state.num_processed]
            state.num_processed += 1
            if (state.num_processed == len(output_ids) and self._ended_by_stop_token(seq)
                    and not params.include_stop_str_in_output):
                continue  # like vLLM: the EOS / stop token's own text is not part of the output
            start = len(state.text)
            state.text += state.detokenizer.add_token(token_id)
            if params.stop and state.num_processed >= params.min_tokens:
                hit = find_stop_string(state.text, start, params.stop)
                if hit is not None:
                    state.text = truncate_at_stop(state.text, hit[0], hit[1],
                                                  params.include_stop_str_in_output)
                    self._stop(seq, hit[1])
                    state.done = True
        if seq.status.is_finished and not state.done:
            state.text += state.detokenizer.flush()
            state.done = True
        return new > 0 or seq.status.is_finished

    @staticmethod
    def _ended_by_stop_token(seq: Sequence) -> bool:
        return seq.status == SequenceStatus.FINISHED_STOPPED and not isinstance(seq.stop_reason, str)

    def _stop(self, seq: Sequence, stop: str) -> None:
        if seq.status.is_finished:  # finished by the scheduler on this very token (e.g. max_tokens)
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        else:
            self._finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)

    def _make_output(self, request: _RequestState) -> RequestOutput:
        group = request.group
        params = group.sampling_params
        completions = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            state = self._state(request, seq)
            text = state.text
            if not state.done and params.stop and not params.include_stop_str_in_output:
                text = text[: len(text) - partial_stop_len(text, params.stop)]
            logprobs = state.logprobs
            first_token = first_char = 0
            if params.output_kind == RequestOutputKind.DELTA:
                first_token, first_char = state.sent_tokens, state.sent_chars
                state.sent_tokens, state.sent_chars = seq.num_output_tokens, len(text)
            completions.append(CompletionOutput(
                index=seq.index,
                text=text[first_char:],
                token_ids=seq.token_ids[seq.num_prompt_tokens + first_token:],
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=logprobs[first_token:] if logprobs is not None else None,
                cumulative_logprob=state.cumulative_logprob if logprobs is not None else None,
            ))
        finished = group.is_finished
        if finished:
            del self._requests[group.request_id]
            for c in completions:
                self.finished_by_reason[c.finish_reason] += 1
            if group.metrics.finished_time is None:
                group.metrics.finished_time = self._clock()
        return RequestOutput(
            request_id=group.request_id,
            prompt=request.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=dataclasses.replace(group.metrics),
            finish_message=group.finish_message,
            prompt_logprobs=request.prompt_logprobs
            if request.prompt_logprobs is not None
            and len(request.prompt_logprobs) == len(group.prompt_token_ids) else None,
            embedding=request.embedding,
        )
