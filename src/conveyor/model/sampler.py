"""Sampling on batched logits with per-row parameters.

One row per sampled token (an n>1 fork repeats its logits row n times). Order, as in
transformers: repetition / presence / frequency penalties, temperature, top-k, top-p, min-p.
Before ``min_tokens`` outputs exist, EOS and ``stop_token_ids`` are masked out (as vLLM does),
so a request never emits a stop token it is not allowed to stop on.
Greedy rows (temperature 0) take the argmax of the penalized logits.

Randomness: each row draws a single uniform number and picks the token where the cumulative
probability crosses it (inverse CDF). For a request with a ``seed`` that number is a hash of
(seed, sample index, position), so its tokens do not depend on what else is in the batch;
rows without a seed draw from the executor's generator.
Logprobs are those of the raw model distribution (log-softmax of the unprocessed logits), or,
for a row under a structured-output grammar, of that distribution masked to the tokens the
grammar allows (the mask comes first: see docs/structured_outputs.md). A constrained row's
``min_tokens`` does not mask stop tokens: its grammar decides where it may end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.model.kernels import fused_ops
from conveyor.model.logit_bias import apply_logit_bias
from conveyor.model.token_bitmask import apply_token_bitmask

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, sample_index: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, sample index, position)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ sample_index) ^ position)
    return (h >> 11) / float(1 << 53)


@dataclass
class SampleRow:
    """One token to sample: its request's params, token history and where the token goes."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sample_index: int  # which of the request's n samples
    position: int  # the new token's position in its sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row, when any row asked for logprobs


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: the C++ pass on the CPU (one pass over each row), else
    max().indices (as argmax, but faster on the CPU)."""
    chosen = fused_ops.argmax(logits)
    return chosen if chosen is not None else logits.max(dim=-1).indices


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 grammar: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        """logits: [R, vocab] in the model's dtype, one row per entry of ``rows``.

        ``grammar``: (packed token bitmask, per row the bitmask row to apply or -1); it masks
        ``logits`` in place.

        Plain greedy rows (no penalties, no logprobs) take the maximum in that dtype: converting
        to float32 is exact, so the choice is the same, and skipping the copy saves a pass over
        the logits. Everything else is computed in float32.
        """
        device, vocab = logits.device, logits.shape[1]
        constrained = apply_token_bitmask(logits, *grammar) if grammar is not None else []
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs for p in params]
        plain_greedy = all(p.temperature == 0.0 and p.logprobs is None and p.repetition_penalty == 1.0
                           and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                           and not p.logit_bias for p in params)
        if not plain_greedy:
            logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(n is not None for n in want_logprobs) else None)
        logits = self._adjust(logits, rows, vocab, set(constrained))  # out of place

        is_greedy = [p.temperature == 0.0 for p in params]
        if all(is_greedy):
            chosen = _greedy(logits)
        else:
            chosen = self._sample(logits, rows, vocab)
            if any(is_greedy):
                greedy = torch.tensor(is_greedy, device=device)
                chosen = torch.where(greedy, _greedy(logits), chosen)
        token_ids = chosen.tolist()

        logprob_dicts = None
        if raw_logprobs is not None:
            top_n = max(n or 0 for n in want_logprobs)
            top_vals, top_idx = (raw_logprobs.topk(top_n, dim=-1) if top_n else (None, None))
            chosen_lp = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
            logprob_dicts = []
            for i, n in enumerate(want_logprobs):
                d = {token_ids[i]: chosen_lp[i]}
                if n:
                    for t, lp in zip(top_idx[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True):
                        d.setdefault(t, lp)
                logprob_dicts.append(d)
        return SamplerOutput(token_ids, logprob_dicts)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in rows]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
            seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
            ids = _padded([r.prompt_token_ids + r.output_token_ids for r in rows], vocab, device)
            seen.scatter_(1, ids, True)
            seen = seen[:, :vocab]
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalized, logits)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            counts = torch.zeros(len(rows), vocab + 1, device=device)
            ids = _padded([r.output_token_ids for r in rows], vocab, device)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
            counts = counts[:, :vocab]
            presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
            logits = logits - frequency * counts - presence * (counts > 0)
        return logits

    def _mask_stop_tokens_before_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow],
                                            vocab: int,
                                            constrained: frozenset[int] | set[int] = frozenset()
                                            ) -> torch.Tensor:
        masked = [(i, r.params) for i, r in enumerate(rows)
                  if len(r.output_token_ids) < r.params.min_tokens and i not in constrained]
        if not masked:
            return logits
        logits = logits.clone()
        for i, p in masked:
            ids = [t for t in self.eos_token_ids + p.stop_token_ids if t < vocab]
            logits[i, ids] = float("-inf")
        return logits

    def probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The float32 distribution each random row (temperature > 0) samples from: after
        penalties, logit_bias, the min_tokens mask, temperature, top-k, top-p and min-p (unnormalized)."""
        vocab = logits.shape[1]
        return self._probs(self._adjust(logits.float(), rows, vocab), rows, vocab)

    def _adjust(self, logits: torch.Tensor, rows: list[SampleRow], vocab: int,
                constrained: frozenset[int] | set[int] = frozenset()) -> torch.Tensor:
        """Penalties, logit_bias and the min_tokens mask (not on ``constrained`` rows, whose
        grammar decides when they may end), out of place."""
        logits = self._apply_penalties(logits, rows, vocab)
        logits = apply_logit_bias(logits, [r.params for r in rows])
        return self._mask_stop_tokens_before_min_tokens(logits, rows, vocab, constrained)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> torch.Tensor:
        probs = self._probs(logits, rows, vocab)
        params = [r.params for r in rows]
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), generator=self.generator,
                                            dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                uniforms[i] = seeded_uniform(r.params.seed, r.sample_index, r.position)
        return draw(probs, uniforms)

    def _probs(self, logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in rows]
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             device=device)
        logits = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=device)[None, :]
            drop = rank >= torch.tensor(top_k, device=device)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
            drop = drop | (before >= torch.tensor(top_p, device=device)[:, None])
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (unnormalized): where its cdf crosses ``uniforms`` x total."""
    vocab, device = probs.shape[1], probs.device
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # First token whose cdf reaches u * total; the clamps keep zero-probability tokens out
    # (their cdf equals their predecessor's, which is found first) even at u = 0 or rounding.
    targets = uniforms.to(device=device, dtype=cdf.dtype)[:, None] * total
    targets = torch.minimum(targets.clamp_(min=torch.finfo(cdf.dtype).tiny), total)
    return torch.searchsorted(cdf, targets)[:, 0].clamp_(max=vocab - 1)
