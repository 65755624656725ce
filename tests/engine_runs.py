"""Helpers shared by tests (``tests/`` is on pytest's python path): run requests on an
LLMEngine to the end; a finished request's samples as token ids and logprobs."""

from __future__ import annotations

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput


def run_to_end(engine: LLMEngine,
               requests: list[tuple[object, SamplingParams | PoolingParams]],
               prefix: str = "") -> list[RequestOutput]:
    """Adds every request at once (ids ``prefix + index``), steps the engine until nothing is
    left, and returns each request's finished output, in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{prefix}{i}", prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{prefix}{i}"] for i in range(len(requests))]


def samples(out: RequestOutput) -> list[tuple[list[int], list[float]]]:
    """A finished request's samples as (token ids, chosen-token logprobs); the request must have
    asked for logprobs."""
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs,
                                                                strict=True)])
            for c in out.outputs]
