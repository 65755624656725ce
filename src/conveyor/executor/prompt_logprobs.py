"""Prompt logprobs: for a request that asks for them, the model's log-probability of each prompt
token given the tokens before it (and the top-N alternatives), as vLLM's ``prompt_logprobs``.

A prefill chunk covering prompt positions ``[start, start + count)`` scores the tokens at
``start + 1 .. start + count`` that are still prompt: the logits at position p predict token
p + 1. Those positions' logits are asked of the model beside the sampling ones (the block
manager gives such requests no prefix-cache hits, so every position is computed once)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.core.sequence import Sequence

SCORE_ROWS = 128  # logits rows scored at once


@dataclass
class PromptScoring:
    """One entry's prompt positions to score in this step."""

    entry: int  # index in the SchedulerOutput
    first_target: int  # position of the first prompt token scored
    targets: list[int]  # the prompt tokens scored (one per logits row)
    top_n: int


def positions_to_score(entry: int, seq: Sequence, start: int, count: int) -> PromptScoring | None:
    """What entry ``entry`` (a chunk of ``count`` tokens from ``start``) scores; None if its
    request wants no prompt logprobs or the chunk predicts no prompt token."""
    top_n = seq.group.sampling_params.prompt_logprobs
    if top_n is None:
        return None
    end = min(start + count, seq.num_prompt_tokens - 1)  # last position predicting a prompt token
    if end <= start:
        return None
    return PromptScoring(entry, start + 1, seq.token_ids[start + 1:end + 1], top_n)


def score(logits: torch.Tensor, scorings: list[PromptScoring]
          ) -> dict[int, tuple[int, list[dict[int, tuple[float, int]]]]]:
    """``logits``: one row per target of ``scorings``, in order. Per entry: (first target
    position, per target {token_id: (logprob, rank)} for the target and the top-N).

    Rows are scored ``SCORE_ROWS`` at a time, and only the asked-for numbers leave a slice: the
    memory beyond the logits stays ``SCORE_ROWS`` x vocabulary however long the prompt."""
    targets = torch.tensor([t for s in scorings for t in s.targets], device=logits.device)
    top_n = max(s.top_n for s in scorings)
    target_lps: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for first in range(0, logits.shape[0], SCORE_ROWS):
        logprobs = torch.log_softmax(logits[first:first + SCORE_ROWS].float(), dim=-1)
        target_lp = logprobs.gather(1, targets[first:first + SCORE_ROWS, None])
        target_lps += target_lp[:, 0].tolist()
        ranks += ((logprobs > target_lp).sum(dim=-1, dtype=torch.int32) + 1).tolist()
        if top_n:
            values, ids = logprobs.topk(top_n, dim=-1)
            top_lps += values.tolist()
            top_ids += ids.tolist()
    out = {}
    row = 0
    for s in scorings:
        entries = []
        for target in s.targets:
            d = {target: (target_lps[row], ranks[row])}
            for k in range(s.top_n):
                d.setdefault(top_ids[row][k], (top_lps[row][k], k + 1))
            entries.append(d)
            row += 1
        out[s.entry] = (s.first_target, entries)
    return out
