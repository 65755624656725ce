"""A saturated server (2 sequences at a time): priorities under --queue priority, 503 past
--max-queued-requests, and a graceful SIGTERM that lets the running stream finish, exit 0."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)



def _max_queued(server) -> int:
    return int(server.args[server.args.index("--max-queued-requests") + 1])


def _body(priority: int, max_tokens: int, i: int) -> dict:
    return {"prompt": f"Item {i}: tell me about the sea.", "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True, "priority": priority}


async def _stream(http: httpx.AsyncClient, body: dict, on_first_token=None) -> int:
    """Streams one completion; returns its number of completion chunks."""
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                if chunks == 0 and on_first_token is not None:
                    on_first_token()
                chunks += 1
    return chunks


async def _wait_metric(server, name: str, value: float, polls: int = 400) -> None:
    for _ in range(polls):
        if (await asyncio.to_thread(server.metrics))[name] == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached {value}")


def test_high_priority_first_token_before_earlier_low_priority(busy_server) -> None:
    order = itertools.count()
    first_token: dict[str, int] = {}

    def mark(name: str):
        return lambda: first_token.setdefault(name, next(order))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=busy_server.base_url, timeout=240) as http:
            # the blockers hold both slots until every request is queued (however fast the
            # steps), then their clients leave and the queue alone decides who goes next
            blockers = [asyncio.create_task(_stream(http, _body(10, 400, i))) for i in range(2)]
            await _wait_metric(busy_server, "conveyor:num_requests_running", 2)
            lows = [asyncio.create_task(_stream(http, _body(10, 4, 10 + i), mark(f"low{i}")))
                    for i in range(3)]
            await _wait_metric(busy_server, "conveyor:num_requests_waiting", 3)
            highs = [asyncio.create_task(_stream(http, _body(-10, 4, 20 + i), mark(f"high{i}")))
                     for i in range(2)]
            await _wait_metric(busy_server, "conveyor:num_requests_waiting", 5)
            for t in blockers:
                t.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
            await asyncio.gather(*lows, *highs)

    asyncio.run(run())
    assert len(first_token) == 5
    last_high = max(first_token[f"high{i}"] for i in range(2))
    first_low = min(first_token[f"low{i}"] for i in range(3))
    assert last_high < first_low, first_token


def test_overload_answers_503_then_recovers(busy_server) -> None:
    max_queued = _max_queued(busy_server)
    before = busy_server.metrics()

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=busy_server.base_url, timeout=240) as http:
            tasks = [asyncio.create_task(_stream(http, _body(0, 100, i))) for i in range(2)]
            await _wait_metric(busy_server, "conveyor:num_requests_running", 2)
            tasks += [asyncio.create_task(_stream(http, _body(0, 100, 2 + i)))
                      for i in range(max_queued)]
            await _wait_metric(busy_server, "conveyor:num_requests_waiting", max_queued)
            refused = await http.post("/v1/completions", json=_body(0, 4, 99))
            for t in tasks:  # the clients leave: every one of them is aborted
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _wait_metric(busy_server, "conveyor:num_requests_running", 0)
            await _wait_metric(busy_server, "conveyor:num_requests_waiting", 0)
            return refused

    refused = asyncio.run(run())
    assert refused.status_code == 503
    err = refused.json()["error"]
    assert "overloaded" in err["message"] and str(max_queued) in err["message"]
    assert err["type"] == "server_error"
    after = busy_server.metrics()
    aborted = "conveyor:request_success_total{finished_reason=abort}"
    assert after[aborted] - before[aborted] == 2 + max_queued
    assert after["conveyor:kv_cache_usage_perc"] == 0.0
    ok = httpx.post(busy_server.base_url + "/v1/completions",
                    json={"prompt": "Hello", "max_tokens": 2, "priority": 3}, timeout=60)
    assert ok.status_code == 200


def test_sigterm_finishes_running_stream_and_exits_0(busy_server) -> None:
    """While draining, the listener stays open: new requests get 503 with OpenAI's error body,
    /health is 503, the running stream finishes whole, then the process exits 0."""
    body = _body(0, 64, 0)  # long enough to be still running while the others are sent
    body["stream_options"] = {"include_usage": True}
    lines: list[str] = []
    during: list[httpx.Response] = []
    with httpx.stream("POST", busy_server.base_url + "/v1/completions", json=body,
                      timeout=240) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if len(lines) == 1:  # mid-stream
                busy_server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)  # the signal is handled between two bytecodes of the server
                during.append(httpx.get(busy_server.base_url + "/health", timeout=30))
                during.append(httpx.post(busy_server.base_url + "/v1/completions",
                                         json={"prompt": "Hello", "max_tokens": 2}, timeout=30))
    usage = json.loads(lines[-2][6:])["usage"]
    assert lines[-1] == "data: [DONE]"
    assert usage["completion_tokens"] == 64
    health, refused = during
    assert refused.status_code == 503, refused.text
    err = refused.json()["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error"
    assert health.status_code == 503
    assert busy_server.proc.wait(60) == 0
