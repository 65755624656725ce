"""OpenAIServing's lifecycle in process, over a scripted engine: admission and its release, the
merged outputs (token counts, each failure an APIError, what is unfinished aborted) and OpenAI's
chunk stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest
from starlette.requests import Request

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.sequence import RequestMetrics
from conveyor.engine.args import EngineArgs
from conveyor.engine.outputs import CompletionOutput, RequestOutput
from conveyor.entrypoints.openai.admission import SequenceAdmission
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.serving import Job, OpenAIServing, Run
from conveyor.entrypoints.openai.state import ServerState

HANG = "hang"  # a script step: the request runs until it is closed


def delta(request_id: str, token_ids: list[int], finish_reason: str | None = None,
          cached: int = 0) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2, 3],
                         [CompletionOutput(0, "x" * len(token_ids), token_ids, finish_reason)],
                         finish_reason is not None,
                         RequestMetrics(arrival_time=0.0, num_cached_tokens=cached))


class ScriptedEngine:
    """Plays each request's script (deltas, an exception to raise, or HANG) and records the
    requests closed before their script ended (the AsyncEngine aborts those)."""

    def __init__(self, scripts: dict[str, list[Any]], queued: int = 0) -> None:
        self.scripts = scripts
        self.queued = queued
        self.aborted: list[str] = []
        self.error: BaseException | None = None

    def num_queued_requests(self) -> int:
        return self.queued

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str,
                       priority: int = 0, fairness_key: str | None = None,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        try:
            for step in self.scripts[request_id]:
                await asyncio.sleep(0)
                if step == HANG:
                    await asyncio.Event().wait()
                if isinstance(step, Exception):
                    raise step
                yield step
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request_id)
            raise


def serving_over(engine: ScriptedEngine, max_sequences: int | None = None,
                 max_queued: int | None = None) -> OpenAIServing:
    state = ServerState(EngineArgs(), max_queued_requests=max_queued)
    state.engine = engine  # type: ignore[assignment]
    state.admission = SequenceAdmission(max_sequences)
    return OpenAIServing(state, ServerLimits())


def http_request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})


def job(request_id: str) -> Job:
    return Job(request_id, [1, 2, 3], SamplingParams(), 0, prompt_text=f"prompt of {request_id}")


def admitted(serving: OpenAIServing, request_ids: list[str], num_seqs: int = 1) -> Run:
    async def prepare(engine: Any) -> list[Job]:
        return [job(r) for r in request_ids]

    return asyncio.run(serving.admit(http_request(), "req", len(request_ids), num_seqs, prepare))


async def drain(serving: OpenAIServing, run: Run) -> list[tuple[int, RequestOutput]]:
    """Every output of ``run`` (a job that would hang past 10 s fails the test)."""
    async def collect() -> list[tuple[int, RequestOutput]]:
        async with aclosing(serving.outputs(run)) as outputs:
            return [item async for item in outputs]

    return await asyncio.wait_for(collect(), 10)


def test_outputs_merge_the_jobs_and_count_their_tokens() -> None:
    engine = ScriptedEngine({"a": [delta("a", [5, 6], cached=2), delta("a", [7], "stop", 2)],
                             "b": [delta("b", [8], "length", cached=0)]})
    serving = serving_over(engine)
    run = admitted(serving, ["a", "b"])
    got = asyncio.run(drain(serving, run))
    assert sorted((i, d.outputs[0].token_ids) for i, d in got) == [(0, [5, 6]), (0, [7]),
                                                                   (1, [8])]
    assert run.output_tokens == 4 and run.record.output_tokens == 4
    assert run.usage() == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                           "prompt_tokens_details": {"cached_tokens": 2}}
    assert run.record.prompt == "prompt of a\nprompt of b" and run.record.prompt_tokens == 6
    assert engine.aborted == []


@pytest.mark.parametrize(("failure", "status", "code"), [
    (delta("b", [], "ignored"), 400, "context_length_exceeded"),
    (delta("b", [9], "abort"), 503, "shutting_down"),
    (ValueError("bad adapter"), 400, None),
    (RuntimeError("the engine broke"), 500, None),
])
def test_a_failing_job_ends_the_outputs_with_an_api_error_and_aborts_the_rest(
        failure: Any, status: int, code: str | None) -> None:
    engine = ScriptedEngine({"a": [delta("a", [5]), HANG], "b": [failure]})
    serving = serving_over(engine)
    run = admitted(serving, ["a", "b"])
    with pytest.raises(APIError) as raised:
        asyncio.run(drain(serving, run))
    assert (raised.value.status, raised.value.code) == (status, code)
    assert engine.aborted == ["a"]


def test_admission_refuses_a_full_queue_and_a_failed_prepare_releases_its_sequences() -> None:
    full = serving_over(ScriptedEngine({}, queued=2), max_queued=2)
    with pytest.raises(APIError) as raised:
        admitted(full, ["a"])
    assert (raised.value.status, raised.value.code) == (503, "overloaded")
    assert full.state.admission.in_flight == 0

    serving = serving_over(ScriptedEngine({}), max_sequences=4)

    async def failing_prepare(engine: Any) -> list[Job]:
        assert serving.state.admission.in_flight == 3  # held while preparing
        raise APIError(400, "the template rejected the messages")

    with pytest.raises(APIError):
        asyncio.run(serving.admit(http_request(), "req", 1, 3, failing_prepare))
    assert serving.state.admission.in_flight == 0
    run = admitted(serving, ["a"], num_seqs=3)
    assert serving.state.admission.in_flight == 3
    run.reservation.release()
    assert serving.state.admission.in_flight == 0


def test_chunk_events_end_a_failed_stream_with_its_error_usage_and_done() -> None:
    engine = ScriptedEngine({"a": [delta("a", [5], cached=1), delta("a", [], "abort")]})
    serving = serving_over(engine)
    run = admitted(serving, ["a"])

    async def choices() -> AsyncIterator[dict[str, Any]]:
        async with aclosing(serving.outputs(run)) as outputs:
            async for _, d in outputs:
                yield {"index": 0, "text": d.outputs[0].text}

    async def events() -> list[str]:
        head = {"id": "req", "object": "text_completion"}
        async with aclosing(serving.chunk_events(run, head, True, choices())) as stream:
            return [event async for event in stream]

    data = [e.removeprefix("data: ").strip() for e in asyncio.run(events())]
    assert json.loads(data[0])["choices"] == [{"index": 0, "text": "x"}]
    assert json.loads(data[0])["usage"] is None
    assert json.loads(data[1])["error"]["code"] == "shutting_down"
    assert json.loads(data[2])["usage"]["completion_tokens"] == 1
    assert data[3] == "[DONE]" and len(data) == 4
