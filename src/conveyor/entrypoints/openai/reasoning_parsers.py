"""Reasoning in a model's text (``--reasoning-parser``): the part between ``<think>`` and
``</think>`` is the reasoning, the rest the answer.

* ``qwen3``: the reply opens the block itself; a reply that does not start with ``<think>``
  (leading whitespace aside) has no reasoning.
* ``deepseek_r1``: the chat template may open the block in the prompt, so the reply starts
  inside the reasoning (an opening ``<think>`` of its own is skipped) and only ``</think>`` ends
  it; a reply without ``</think>`` is all reasoning.

Reasoning cut short (``max_tokens`` before ``</think>``) is reasoning with no answer. Whitespace
right after a marker and right before ``</think>`` is dropped. ``ReasoningStream`` splits a
streamed reply, delta by delta, holding back text that may be the start of a marker split
across deltas; ``split_reasoning`` runs it over a whole reply, so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_prompt: bool  # the reply starts inside the reasoning
    start: str = "<think>"
    end: str = "</think>"

    def constraint_markers(self, tokenizer: Any) -> dict[str, tuple[int, ...]]:
        """``StructuredOutputsParams``' fields that keep a constraint off the reasoning: the
        markers' tokens (one special token each for Qwen3 and DeepSeek-R1); no start marker
        when the reply starts inside the reasoning."""
        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return {"reasoning_start": () if self.opens_in_prompt else ids(self.start),
                "reasoning_end": ids(self.end)}


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", opens_in_prompt=False),
                     "deepseek_r1": ReasoningParser("deepseek_r1", opens_in_prompt=True)}


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStream:
    """One reply's reasoning and answer, delta by delta; ``parser`` None: all answer."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self.parser = parser
        self.mode = "start" if parser is not None else "answer"  # start, reasoning, answer
        self.has_reasoning = False
        self._held = ""  # text not yet placed: it may begin a marker
        self._trim = True  # at the start of a part: leading whitespace is dropped

    @property
    def in_reasoning(self) -> bool:
        return self.mode != "answer"

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text that ``text`` completes; ``last``: the reply has ended, so
        nothing is held back."""
        if self.parser is None:
            return "", text
        reasoning, answer = [], []
        buf = self._held + text
        self._held = ""
        while buf:
            if self.mode == "start":
                buf = self._open(buf, last)
            elif self.mode == "reasoning":
                buf = self._reason(buf, last, reasoning)
            else:
                answer.append(self._part(buf))
                buf = ""
        return "".join(reasoning), "".join(answer)

    def _part(self, text: str) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        return text

    def _open(self, buf: str, last: bool) -> str:
        """Decide whether the reply opens with the start marker; what follows is left."""
        assert self.parser is not None
        start = self.parser.start
        head = buf.lstrip()
        if head.startswith(start):
            self.mode, self.has_reasoning, self._trim = "reasoning", True, True
            return head[len(start):]
        if start.startswith(head) and not last:
            self._held = buf  # maybe the marker's beginning: wait for more
            return ""
        self.mode = "reasoning" if self.parser.opens_in_prompt else "answer"
        self.has_reasoning = self._trim = self.mode == "reasoning"  # a plain reply is kept whole
        return buf

    def _reason(self, buf: str, last: bool, out: list[str]) -> str:
        assert self.parser is not None
        end = self.parser.end
        at = buf.find(end)
        if at >= 0:
            out.append(self._part(buf[:at].rstrip()))
            self.mode, self._trim = "answer", True
            return buf[at + len(end):]
        keep = 0 if last else _partial_suffix(buf, end)
        body = buf[:len(buf) - keep]
        if not last:  # trailing whitespace waits: it is dropped if the marker follows
            keep += len(body) - len(body.rstrip())
            body = body.rstrip()
        self._held = buf[len(buf) - keep:] if keep else ""
        out.append(self._part(body))
        return ""


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning, answer); reasoning None when it has none."""
    stream = ReasoningStream(parser)
    reasoning, answer = stream.feed(text, last=True)
    return (reasoning if stream.has_reasoning and reasoning else None), answer
