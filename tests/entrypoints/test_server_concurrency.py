"""Many streams at once, and clients that leave: every request completes or is aborted, and the
engine ends idle with every KV block free (read from /metrics)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

RUNNING = "conveyor:num_requests_running"
KV = "conveyor:kv_cache_usage_perc"
ABORTED = "conveyor:request_success_total{finished_reason=abort}"


async def _stream_tokens(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> tuple[int, str]:
    stream = await client.completions.create(
        model=model, prompt=f"Request number {i}: write a short story about a robot.",
        max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    finish, usage = None, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    return usage.completion_tokens, finish


def _wait_idle(server, polls: int = 200) -> dict[str, float]:
    """Metrics once the engine reports nothing running (bounded polls, no timing assert)."""
    for _ in range(polls):
        m = server.metrics()
        if m[RUNNING] == 0 and m["conveyor:num_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    return m


def test_64_concurrent_streams_complete(server) -> None:
    max_tokens = 6

    async def run() -> list[tuple[int, str]]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=240)
        async with client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(_stream_tokens(client, model, i, max_tokens)
                                          for i in range(64)))

    before = server.metrics()
    results = asyncio.run(run())
    assert results == [(max_tokens, "length")] * 64
    m = _wait_idle(server)
    assert m[RUNNING] == 0
    assert m[KV] == 0.0
    assert m["conveyor:generation_tokens_total"] - before["conveyor:generation_tokens_total"] \
        == 64 * max_tokens
    finished = "conveyor:request_success_total{finished_reason=length}"
    assert m[finished] - before[finished] == 64
    assert m["conveyor:time_to_first_token_seconds_count"] \
        - before["conveyor:time_to_first_token_seconds_count"] == 64
    assert m["conveyor:e2e_request_latency_seconds_count"] \
        - before["conveyor:e2e_request_latency_seconds_count"] == 64


def test_disconnect_aborts_and_frees_while_others_continue(server) -> None:
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)  # ~300 tokens
    body = {"prompt": long_prompt, "max_tokens": 200, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    others_tokens = 30

    async def run() -> tuple[dict, dict, list]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=240) as http:
            client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                        max_retries=0, timeout=240, http_client=http)
            model = (await client.models.list()).data[0].id
            others = [asyncio.create_task(_stream_tokens(client, model, i, others_tokens))
                      for i in range(2)]
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()  # held, so that nothing closes it behind our back
                got = 0
                while got < 3:
                    line = await anext(lines)
                    if line.startswith("data: {"):
                        got += len(json.loads(line[6:])["choices"])
                before = await asyncio.to_thread(server.metrics)
                assert before[RUNNING] == 3
            # The response is closed: the server must abort the request within a step.
            after = before
            for _ in range(200):
                after = await asyncio.to_thread(server.metrics)
                if after[ABORTED] > before[ABORTED]:
                    break
                await asyncio.sleep(0.05)
            still_running = [not t.done() for t in others]
            return before, after, [await t for t in others] + [still_running]

    before, after, results = asyncio.run(run())
    *streams, still_running = results
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[RUNNING] <= before[RUNNING] - 1
    # Its ~19 prompt blocks went back to the pool while the two short streams kept going.
    assert after[KV] < before[KV]
    assert any(still_running), "the other streams should still be running at the abort"
    assert streams == [(others_tokens, "length")] * 2
    m = _wait_idle(server)
    assert m[RUNNING] == 0 and m[KV] == 0.0
