"""RequestOutput and CompletionOutput: what the engine hands back for a request (vLLM's fields).

By default outputs are cumulative: each one carries the whole text and token ids generated so
far. ``SamplingParams.output_kind`` asks for deltas (only what is new since the request's last
output) or for the final output alone (``RequestOutputKind``).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.sequence import RequestMetrics


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position, with the token's text."""

    logprob: float
    decoded_token: str | None = None
    rank: int | None = None  # 1 for the most likely token (set for prompt logprobs)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "ignored" | None (running)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Per generated token: {token_id: Logprob} for the sampled token and the top-N alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None  # None when the request was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    finish_message: str | None = None  # why the request was ignored or aborted
    # with SamplingParams.prompt_logprobs, once the prompt is computed: None for the first
    # token, then per prompt token {token_id: Logprob} with the token and the top-N
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a pooling request's vector once its prompt is computed (its one completion stays empty)
    embedding: list[float] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0
