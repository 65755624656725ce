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
    position, per target {token_id: (logprob, rank)} for the target and the top-N)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([t for s in scorings for t in s.targets], device=logprobs.device)
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
    target_lp = target_lp[:, 0].tolist()
    top_n = max(s.top_n for s in scorings)
    top_vals, top_idx = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    out = {}
    row = 0
    for s in scorings:
        entries = []
        for target in s.targets:
            d = {target: (target_lp[row], ranks[row])}
            if s.top_n:
                for k, (t, lp) in enumerate(zip(top_idx[row, :s.top_n].tolist(),
                                                top_vals[row, :s.top_n].tolist(), strict=True)):
                    d.setdefault(t, (lp, k + 1))
            entries.append(d)
            row += 1
        out[s.entry] = (s.first_target, entries)
    return out
