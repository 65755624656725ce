"""POST /v1/completions: one engine request per prompt, streamed (SSE) or returned whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.entrypoints.openai.errors import bad_request
from conveyor.entrypoints.openai.limits import check_sizes
from conveyor.entrypoints.openai.logprobs import (
    TokenText,
    check_prompt_logprobs,
    echo_logprobs,
    prepend,
    sampled_logprob,
    top_entries,
    vllm_prompt_logprobs,
)
from conveyor.entrypoints.openai.protocol import CompletionRequest
from conveyor.entrypoints.openai.serving import Choice, Job, OpenAIServing, Run, new_id, now_s
from conveyor.entrypoints.openai.structured import compile_constraint, constraint_param

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import Logprob


def _num_prompts(prompt: Any) -> int:
    """How many prompts the prompt field holds (a string or token ids are one)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _logprobs(tok: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]], n: int,
              offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = tok(token_id, entry.get(token_id))
        tokens.append(text)
        token_logprobs.append(sampled_logprob(entry, token_id))
        tops.append({tok(t, lp): lp.logprob for t, lp in top_entries(entry, n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        check_sizes(req, self.limits)
        self.check_request(req.model, req.priority)
        if req.suffix:
            raise bad_request("'suffix' is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("'best_of' must equal 'n' (or be omitted)", param="best_of")
        check_prompt_logprobs(req)
        num_prompts = _num_prompts(req.prompt)
        request_id = new_id("cmpl")
        run = await self.admit(request, request_id, num_prompts, num_prompts * req.n,
                               partial(self._jobs, request, req, request_id))
        head = {"id": request_id, "object": "text_completion", "created": now_s(),
                "model": self.model_name(req.model)}
        echo = [(job.prompt_text or "") if req.echo else "" for job in run.jobs]
        if req.stream:
            return self.stream_response(run, self.chunk_events(
                run, head, req.include_usage, self._choice_deltas(run, req, echo)))
        return await self.full_response(request, run, self._whole(run, req, head, echo))

    async def _jobs(self, request: Request, req: CompletionRequest, request_id: str,
                    engine: AsyncEngine) -> list[Job]:
        prompts = await self.state.off_loop(self._prompts, req.prompt, req.echo)
        jobs = []
        for i, (ids, text) in enumerate(prompts):
            max_tokens = self.max_tokens(len(ids), req.max_tokens, "max_tokens")
            jobs.append(Job(f"{request_id}-{i}", ids, self.sampling_params(req, max_tokens),
                            req.priority, text, fairness_key=request_id,
                            lora_request=self.state.lora_request(req.model)))
        await compile_constraint(engine, jobs[0].params, constraint_param(req), request)
        return jobs

    def _prompts(self, prompt: Any, echo: bool) -> list[tuple[list[int], str | None]]:
        """The prompt field (str, list of str, token ids, list of token ids) -> (ids, text)
        pairs; with ``echo``, token-id prompts get their decoded text. Runs on a preprocessing
        thread."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        out = []
        for p in prompt:
            ids = self.prompt_token_ids(p, "prompt")
            text = p if isinstance(p, str) else (self.state.tokenizer.decode(ids) if echo
                                                 else None)
            out.append((ids, text))
        return out

    async def _whole(self, run: Run, req: CompletionRequest, head: dict[str, Any],
                     echo: list[str]) -> Response:
        choices = {(i, j): Choice() for i in range(len(run.jobs)) for j in range(req.n)}
        scored: dict[int, Any] = {}  # job -> its prompt logprobs
        async with aclosing(self.outputs(run)) as outputs:
            async for i, d in outputs:
                if d.prompt_logprobs is not None:
                    scored[i] = d.prompt_logprobs
                for c in d.outputs:
                    choices[(i, c.index)].add(c)
        tok = TokenText(self.state.tokenizer)
        out = []
        for (i, j), ch in sorted(choices.items()):
            lp = None
            if req.logprobs is not None:
                lp = _logprobs(tok, ch.token_ids, ch.logprobs, req.logprobs, len(echo[i]))
                if req.echo:
                    lp = prepend(echo_logprobs(tok, run.jobs[i].prompt_token_ids, scored.get(i),
                                               req.logprobs), lp)
            choice = {"index": i * req.n + j, "text": echo[i] + ch.text, "logprobs": lp,
                      "finish_reason": ch.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(scored.get(i))
            out.append(choice)
        return JSONResponse({**head, "choices": out, "usage": run.usage(),
                             "system_fingerprint": None})

    async def _choice_deltas(self, run: Run, req: CompletionRequest,
                             echo: list[str]) -> AsyncIterator[dict[str, Any]]:
        """Each engine delta of a choice as the choice of a chunk; a choice's first delta
        leads with its echoed prompt."""
        tok = TokenText(self.state.tokenizer)
        offsets: dict[tuple[int, int], int] = {}  # choice -> text offset of its next token
        async with aclosing(self.outputs(run)) as outputs:
            async for i, d in outputs:
                for c in d.outputs:
                    key = (i, c.index)
                    text = c.text
                    first = key not in offsets
                    if first:
                        text = echo[i] + text
                        offsets[key] = len(echo[i])
                    lp = None
                    if req.logprobs is not None:
                        lp = _logprobs(tok, c.token_ids, c.logprobs or [], req.logprobs,
                                       offsets[key])
                        offsets[key] += sum(len(t) for t in lp["tokens"])
                        if req.echo and first:
                            lp = prepend(echo_logprobs(tok, run.jobs[i].prompt_token_ids,
                                                       d.prompt_logprobs, req.logprobs), lp)
                    if not text and c.finish_reason is None and not c.token_ids:
                        continue
                    yield {"index": i * req.n + c.index, "text": text, "logprobs": lp,
                           "finish_reason": c.finish_reason}
