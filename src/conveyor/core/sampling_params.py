"""SamplingParams: how one request is decoded and when it stops. Validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum

from conveyor.core.structured_outputs_params import StructuredOutputsParams


class RequestOutputKind(IntEnum):
    """Which outputs a request yields from ``LLMEngine.step`` (vLLM's names)."""

    CUMULATIVE = 0  # after every step with news: the whole text and token ids so far
    DELTA = 1  # after every step with news: only what is new since the request's last output
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate asks for this)


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM's names and meanings).

    Every field is checked in ``__post_init__``; an invalid value raises ``ValueError``
    whose message names the field and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: only the sampled one)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-N (0..20)
    structured_outputs: StructuredOutputsParams | None = None  # docs/structured_outputs.md

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            fail("temperature", "must be a number in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be a number in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of integers >= 0")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            fail("logprobs", "must be an integer in [0, 20] or None")
        if not is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be a number in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            fail("repetition_penalty", "must be a number in (0, 2]")
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict)
                and all(is_int(t) and t >= 0 for t in self.logit_bias)
                and all(is_num(b) and -100.0 <= b <= 100.0 for b in self.logit_bias.values())):
            fail("logit_bias", "must map token ids (integers >= 0) to numbers in [-100, 100]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            fail("prompt_logprobs", "must be an integer in [0, 20] or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams or None")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a bool")

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        """A copy that asks for ``kind`` of outputs; these params are left as they are."""
        return dataclasses.replace(self, output_kind=kind)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
