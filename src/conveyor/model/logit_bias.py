"""OpenAI's ``logit_bias``: per request, numbers added to chosen tokens' logits before sampling
(-100 all but bans a token, +100 all but forces it). Logprobs stay those of the model."""

from __future__ import annotations

import torch

from conveyor.core.sampling_params import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [R, vocab] (float32) with each row's bias added (``params``: per row); out of
    place, and the same tensor when no row has a bias."""
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return logits
    row_idx, token_idx, values = [], [], []
    for i, bias in biased:
        for token_id, value in bias.items():
            row_idx.append(i)
            token_idx.append(token_id)
            values.append(value)
    device = logits.device
    return logits.index_put((torch.tensor(row_idx, device=device),
                             torch.tensor(token_idx, device=device)),
                            torch.tensor(values, dtype=logits.dtype, device=device),
                            accumulate=True)
