"""PDFleetEngine's orchestration over stand-in replicas (no Ray fleet): a split request streams
the prefill replica's first token, then the decode replica's rest, as one request; a request
that stops at its first token never reaches a decode replica; one that does not split runs whole
on a decode replica; a replica dying mid-request is a 503, one dying before it produced anything
is retried."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.sequence import RequestMetrics
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.entrypoints.openai.errors import APIError

pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402

from conveyor.entrypoints.ray_serve.pd_fleet import PDFleetEngine  # noqa: E402
from conveyor.entrypoints.ray_serve.pd_handoff import KVHandoff  # noqa: E402
from conveyor.entrypoints.ray_serve.stats import RouterStats  # noqa: E402

PROMPT = list(range(100, 140))


def delta(tokens: list[int], reason: str | None, prompt: list[int] = PROMPT,
          cached: int = 0) -> RequestOutput:
    return RequestOutput("r", None, prompt, [CompletionOutput(0, "x" * len(tokens), tokens,
                                                              reason)],
                         reason is not None, RequestMetrics(0.0, num_cached_tokens=cached))


class FakeResponse:
    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item


class FakeHandle:
    """``handle.options(stream=True).generate.remote(**kwargs)``: each call takes the next
    scripted response and records its kwargs."""

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.calls: list[dict[str, Any]] = []
        self.generate = self

    def options(self, stream: bool) -> FakeHandle:
        return self

    def remote(self, **kwargs: Any) -> FakeResponse:
        self.calls.append(kwargs)
        return FakeResponse(self.scripts.pop(0))


def engine(prefill: list[list[Any]], decode: list[list[Any]]):
    info = {"tokenizer": None, "model_config": None, "max_model_len": 512,
            "num_total_blocks": 8}
    p, d = FakeHandle(prefill), FakeHandle(decode)
    return PDFleetEngine(p, d, info, RouterStats(replicas=["p"]), RouterStats(replicas=["d"])), p, d


def run(e: PDFleetEngine, params: SamplingParams) -> list[Any]:
    async def go() -> list[Any]:
        return [x async for x in e.generate({"prompt_token_ids": PROMPT}, params, "r")]
    return asyncio.run(go())


HANDOFF = KVHandoff(PROMPT, 7, b"n" * 16, [], num_cached_tokens=16)


def test_a_split_request_is_one_stream_of_both_halves() -> None:
    e, p, d = engine([[delta([7], None, cached=16), HANDOFF]],
                     [[delta([8, 9], None, PROMPT + [7], 32), delta([10], "length", PROMPT + [7],
                                                                    32)]])
    out = run(e, SamplingParams(max_tokens=4, temperature=0))
    assert [o.outputs[0].token_ids for o in out] == [[7], [8, 9], [10]]
    assert [o.finished for o in out] == [False, False, True]
    assert all(o.prompt_token_ids == PROMPT and o.num_cached_tokens == 16 for o in out)
    assert p.calls[0]["params"].max_tokens == 1 and p.calls[0]["hand_off"]
    assert d.calls[0]["prompt"] == {"prompt_token_ids": PROMPT + [7]}
    assert d.calls[0]["params"].max_tokens == 3 and d.calls[0]["handoff"] is HANDOFF
    assert e.num_queued_requests() == 0


def test_a_request_stopped_at_its_first_token_ends_on_the_prefill_replica() -> None:
    e, _, d = engine([[delta([2], "stop")]], [])
    out = run(e, SamplingParams(max_tokens=4))
    assert [o.finished for o in out] == [True] and not d.calls


def test_a_request_that_does_not_split_runs_whole_on_a_decode_replica() -> None:
    e, p, d = engine([], [[delta([1, 2], "length")]])
    run(e, SamplingParams(max_tokens=2, n=2))
    run_one = SamplingParams(max_tokens=1)
    e.handle.scripts.append([delta([1], "length")])
    run(e, run_one)
    assert not p.calls and len(d.calls) == 2 and "handoff" not in d.calls[0]


def test_a_prefill_replica_dying_after_the_first_token_is_a_503() -> None:
    e, _, d = engine([[delta([7], None), RayActorError()]], [])
    with pytest.raises(APIError) as err:
        run(e, SamplingParams(max_tokens=4))
    assert err.value.status == 503 and err.value.code == "replica_died" and not d.calls


def test_a_decode_replica_dying_before_its_first_token_is_retried_later_a_503() -> None:
    e, _, d = engine([[delta([7], None), HANDOFF]],
                     [[RayActorError()], [delta([8], "length", PROMPT + [7])]])
    out = run(e, SamplingParams(max_tokens=2))
    assert [o.outputs[0].token_ids for o in out] == [[7], [8]] and len(d.calls) == 2
    e, _, _ = engine([[delta([7], None), HANDOFF]], [[delta([8], None), RayActorError()]])
    with pytest.raises(APIError) as err:
        run(e, SamplingParams(max_tokens=4))
    assert err.value.status == 503
