"""LLM: the offline API — a batch of prompts in, their outputs back in the same order.

``LLM.generate`` queues every prompt on one LLMEngine and steps it until all are done, with a
tqdm bar showing requests done and output tokens per second; ``LLM.chat`` renders
conversations with the model's chat template first. ``LLM.embed`` runs pooling requests on the
same engine (one vector per prompt) and ``LLM.score`` compares texts by their vectors.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.chat import chat_prompt
from conveyor.engine.llm_engine import LLMEngine, Prompt
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.scoring import pair_scores, score_inputs
from conveyor.lora.request import LoRARequest


class LLM:
    """``LLM(model=None, **EngineArgs fields)``; ``model=None`` is the embedded SmolLM2."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or ``{"prompt_token_ids": ...}``);
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        prompts = _as_prompt_list(prompts)
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        return self._submit(prompts, _as_params_list(sampling_params, len(prompts)), use_tqdm,
                            loras)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[list[float]]:
        """One vector per prompt (the model's pooling unless ``pooling_params`` says otherwise).
        ValueError when a prompt cannot run (e.g. longer than max_model_len)."""
        prompts = _as_prompt_list(prompts)
        outputs = self._submit(prompts, [pooling_params or PoolingParams()] * len(prompts),
                               use_tqdm)
        for out in outputs:
            if out.embedding is None:
                raise ValueError(out.finish_message or f"request {out.request_id} gave no vector")
        return [out.embedding for out in outputs]

    def score(self, text_1: str | Seq[str], text_2: str | Seq[str],
              use_tqdm: bool = True) -> list[float]:
        """Cosine similarity of ``text_1`` with each of ``text_2`` (or of two lists pairwise)."""
        texts, pairs = score_inputs(text_1, text_2)
        return pair_scores(self.embed(texts, use_tqdm=use_tqdm), pairs)

    def _submit(self, prompts: list[Prompt], params: list[SamplingParams | PoolingParams],
                use_tqdm: bool, loras: list[LoRARequest | None] | None = None
                ) -> list[RequestOutput]:
        request_ids = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                request_id = f"llm-{next(self._ids)}"
                self.llm_engine.add_request(request_id, prompt, p, lora_request=lora)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:  # leave the engine as it was: nothing half-done
                self.llm_engine.abort_request(request_id)
            raise

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt(self.llm_engine.tokenizer, conv, add_generation_prompt)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        start = time.perf_counter()
        output_tokens = 0
        while pending:
            for out in self.llm_engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output {output_tokens / elapsed:.1f} tok/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [_final_only(params or SamplingParams())] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return [_final_only(p) for p in params]


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy that asks for the finished output only: ``generate`` reads nothing else, so the
    engine need not build an output per request per step. (Anything else is passed on for
    ``add_request`` to refuse.)"""
    if not isinstance(params, SamplingParams):
        return params
    return params.with_output_kind(RequestOutputKind.FINAL_ONLY)
