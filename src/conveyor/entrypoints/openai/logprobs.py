"""Logprobs as the API shows them: token texts (decoded, not BPE symbols), the sampled token's
logprob and the top entries of a position; the prompt's logprobs in completions' ``echo`` shape
(the prompt's tokens lead the choice's ``logprobs``, the first with ``null``) and in vLLM's
``prompt_logprobs`` field (per prompt token ``null`` or ``{token_id: {"logprob", "rank",
"decoded_token"}}``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.entrypoints.openai.errors import bad_request

if TYPE_CHECKING:
    from conveyor.engine.outputs import Logprob

PromptLogprobs = list["dict[int, Logprob] | None"]


class TokenText:
    """token id -> its text as OpenAI shows it in logprobs (decoded, not the BPE symbol)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id])
            self._cache[token_id] = text
        return text


def sampled_logprob(entry: dict[int, Logprob], token_id: int) -> float | None:
    lp = entry.get(token_id)
    return None if lp is None else lp.logprob


def top_entries(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The n most likely (token, Logprob) of one position."""
    return sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]


def check_prompt_logprobs(req: Any) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' is not supported with 'stream'",
                          param="prompt_logprobs")


def echo_logprobs(tok: TokenText, prompt_ids: list[int], scored: PromptLogprobs | None,
                  top_n: int) -> dict[str, Any]:
    """The prompt's part of a completions ``logprobs`` object (offsets from 0)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    scored = scored or [None] * len(prompt_ids)
    for token_id, entry in zip(prompt_ids, scored, strict=True):
        text = tok(token_id, entry.get(token_id) if entry else None)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(entry[token_id].logprob)
            tops.append({tok(t, lp): lp.logprob for t, lp in top_entries(entry, top_n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def prepend(prompt_part: dict[str, Any], rest: dict[str, Any] | None) -> dict[str, Any]:
    if rest is None:
        return prompt_part
    return {key: prompt_part[key] + rest[key] for key in prompt_part}


def vllm_prompt_logprobs(scored: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    if scored is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()} for entry in scored]
