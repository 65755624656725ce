"""Verification of speculative proposals, the executor's side of speculative decoding.

A decode with a proposal ``d_1 .. d_k`` computes k + 1 tokens in the step (its last token and
the proposal, one multi-token entry over the paged cache, as a prefill chunk is) and gets
logits at each of them: row j scores the token after ``d_1 .. d_j``. Its sample rows see the
proposal as already generated (penalties, ``min_tokens``, seeded positions), exactly as plain
decoding would if it had produced those tokens.

* Greedy rows: ``d_j`` is accepted while it equals row j-1's choice; the first choice that
  differs (or row k's, when all are accepted) is the extra token. With deterministic inference
  each row's logits are bit-identical to a one-token decode's, so the output is token for token
  that of plain greedy decoding.
* Random rows: rejection sampling (Leviathan et al.; Chen et al.) against the proposer's
  distribution ``q`` (one-hot for the n-gram proposer): accept ``d_j`` with probability
  ``min(1, p(d_j) / q(d_j))``, else draw from ``max(p - q, 0)`` and stop; after k acceptances
  draw the extra token from row k. Every emitted token is distributed as the target ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.core.sequence import Sequence
from conveyor.model.sampler import Sampler, SampleRow, draw, seeded_uniform

ACCEPT_SALT = 0x6A09E667F3BCC908  # seeded acceptance draws differ from the token draws


@dataclass
class Proposal:
    """One decode's proposal and where its k + 1 sample rows start."""

    entry: int
    first_row: int
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # [k, vocab] q of each draft; None: one-hot


def proposal_rows(seq: Sequence) -> list[SampleRow]:
    """The k + 1 sample rows of ``seq``'s proposal: row j follows its first j proposed tokens."""
    params = seq.group.sampling_params
    tokens = seq.token_ids + seq.spec_token_ids
    n, prompt = len(seq.token_ids), seq.num_prompt_tokens
    return [SampleRow(params=params, prompt_token_ids=tokens[:prompt],
                      output_token_ids=tokens[prompt:n + j], sample_index=seq.index,
                      position=n + j)
            for j in range(len(seq.spec_token_ids) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow],
           chosen: list[int], proposals: list[Proposal]) -> dict[int, list[int]]:
    """Each proposal's output tokens (accepted ones, then one more), by entry.

    ``chosen``: the sampler's token for every row of ``logits`` (greedy rows' choices).
    """
    out: dict[int, list[int]] = {}
    random = [p for p in proposals if rows[p.first_row].params.temperature > 0]
    for p in proposals:
        if rows[p.first_row].params.temperature == 0:
            out[p.entry] = _accept_greedy(p.drafts, chosen[p.first_row:p.first_row + len(p.drafts) + 1])
    if random:
        index = [r for p in random for r in range(p.first_row, p.first_row + len(p.drafts) + 1)]
        probs = sampler.probs(logits[torch.tensor(index, device=logits.device)],
                              [rows[r] for r in index])
        row = 0
        for p in random:
            n = len(p.drafts) + 1
            out[p.entry] = rejection_sample(probs[row:row + n], p.drafts,
                                            rows[p.first_row:p.first_row + n], sampler.generator,
                                            p.draft_probs)
            row += n
    return out


def _accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    for j, d in enumerate(drafts):
        if targets[j] != d:
            return targets[:j + 1]
    return targets


def rejection_sample(probs: torch.Tensor, drafts: list[int], rows: list[SampleRow],
                     generator: torch.Generator,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens distributed as ``probs`` (k + 1 target rows, unnormalized) given ``drafts``
    proposed from ``draft_probs`` (k rows; None: each draft was certain)."""
    probs = probs.double().cpu()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    tokens: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        q = None if draft_probs is None else draft_probs[j].double().cpu()
        q_d = 1.0 if q is None else float(q[d])
        if _uniform(rows[j], generator, ACCEPT_SALT) * q_d < float(p[d]):
            tokens.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: nothing to correct, p itself is the law
            residual = p
        u = torch.tensor([_uniform(rows[j], generator, 0)], dtype=torch.float64)
        tokens.append(int(draw(residual[None], u)[0]))
        return tokens
    u = torch.tensor([_uniform(rows[len(drafts)], generator, 0)], dtype=torch.float64)
    tokens.append(int(draw(probs[len(drafts)][None], u)[0]))
    return tokens


def _uniform(row: SampleRow, generator: torch.Generator, salt: int) -> float:
    seed = row.params.seed
    if seed is None:
        return float(torch.rand((), generator=generator, dtype=torch.float64))
    return seeded_uniform(seed ^ salt, row.sample_index, row.position)
