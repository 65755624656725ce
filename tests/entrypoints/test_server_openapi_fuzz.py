"""Schemathesis, driven by the server's own OpenAPI document, against every endpoint (the
statistics stream excepted: it never ends): valid and invalid requests generated from the
request schemas. None may get a 5xx or hang; afterwards the server
is healthy and idle, no KV block is held and every admission slot is free again. Errors come
in each API's shape (OpenAI's; Anthropic's on /v1/messages)."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from long_runs import sized

pytestmark = pytest.mark.timeout(sized(900, 7200))

# per endpoint with a body: valid requests run the model, invalid ones are refused at once
EXAMPLES = {GenerationMode.POSITIVE: sized(100, 5000), GenerationMode.NEGATIVE: sized(250, 5000)}
POST_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                  "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/load_lora_adapter",
                  "/v1/unload_lora_adapter"}
MAX_SEQS_IN_FLIGHT = 8
# a short context and few samples keep every valid request quick on a CPU
FLAGS = ["--max-model-len", "48", "--max-n", "2", "--max-prompts-per-request", "2",
         "--max-sequences-in-flight", str(MAX_SEQS_IN_FLIGHT),
         "--structured-outputs-compile-timeout", "5"]
SEEN: dict[int, int] = {}


@pytest.fixture(scope="module")
def fuzzed(start_server, tmp_path_factory):
    return start_server(FLAGS + ["--batch-dir", str(tmp_path_factory.mktemp("batches"))])


def _operations(base_url: str) -> list[schemathesis.APIOperation]:
    api = schemathesis.openapi.from_url(base_url + "/openapi.json")
    ops = [result.ok() for result in api.get_all_operations()]
    return [op for op in ops if op.path != "/v1/stats/stream"]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_generated_request_gets_a_5xx(fuzzed, mode) -> None:
    operations = _operations(fuzzed.base_url)
    assert POST_ENDPOINTS <= {op.path for op in operations}
    for op in operations:
        has_body = op.method.upper() == "POST" and len(op.body) > 0
        if mode == GenerationMode.NEGATIVE and not has_body:
            continue  # a GET, or a POST of only a path id (a cancel), has nothing to get wrong
        examples = EXAMPLES[mode] if has_body else 10

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            SEEN[response.status_code] = SEEN.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.body, response.text[:500])
            if response.status_code >= 400 and case.path == "/v1/messages":
                body = response.json()  # Anthropic's error shape
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            elif response.status_code >= 400 and case.path.startswith("/v1/"):
                err = response.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], err

        call()


def test_the_server_is_healthy_and_idle_afterwards(fuzzed) -> None:
    assert SEEN.get(200, 0) > 0 and sum(n for s, n in SEEN.items() if s >= 400) > 0, SEEN
    assert sum(SEEN.values()) >= len(POST_ENDPOINTS) * sum(EXAMPLES.values()), SEEN
    base = fuzzed.base_url
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    for _ in range(100):
        m = fuzzed.metrics()
        if m["conveyor:num_requests_running"] == 0 and m["conveyor:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["conveyor:num_requests_running"] == 0 and m["conveyor:num_requests_waiting"] == 0
    assert m["conveyor:kv_cache_usage_perc"] == 0.0
    log = fuzzed.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "request failed" not in log  # app.py's 500 paths
    # every admission slot is free: a request taking all of them is admitted
    whole = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": ["Still", "fine?"], "n": 2, "max_tokens": 2, "ignore_eos": True})
    assert whole.status_code == 200, whole.text
    assert 2 * 2 <= MAX_SEQS_IN_FLIGHT
    full = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2})
    assert full.status_code == 200, full.text
