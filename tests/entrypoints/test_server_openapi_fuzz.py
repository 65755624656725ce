"""Schemathesis, driven by the server's own OpenAPI document, against every endpoint (the
statistics stream excepted: it never ends): valid and invalid requests generated from the
request schemas, and valid ones made hostile (lone surrogates, NUL, very long strings, deeply
nested values, ``NaN``/``Infinity`` literals, whole and streamed) on every POST route. None may
get a 5xx, hang or lose its connection; afterwards the server is healthy and idle, no KV block
is held and every admission slot is free again. Errors come in each API's shape (OpenAI's;
Anthropic's on /v1/messages, Ollama's on /api/)."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from long_runs import sized

pytestmark = pytest.mark.timeout(sized(900, 7200))

# per endpoint with a body: valid requests run the model, invalid ones are refused at once
EXAMPLES = {GenerationMode.POSITIVE: sized(100, 5000), GenerationMode.NEGATIVE: sized(250, 5000)}
HOSTILE_EXAMPLES = sized(30, 2000)  # per POST endpoint
POST_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                  "/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/load_lora_adapter",
                  "/v1/unload_lora_adapter", "/v1/files", "/v1/batches",
                  "/v1/batches/{batch_id}/cancel", "/api/chat", "/api/generate", "/api/embed",
                  "/api/embeddings", "/api/show"}
STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
             "/api/chat", "/api/generate"}
UPLOAD = "/v1/files"  # multipart: its form fields are made hostile, and the file's line
MAX_SEQS_IN_FLIGHT = 8
# a short context and few samples keep every valid request quick on a CPU; runtime LoRA loading
# is on, so that its routes parse what they are sent
FLAGS = ["--max-model-len", "48", "--max-n", "2", "--max-prompts-per-request", "2",
         "--max-sequences-in-flight", str(MAX_SEQS_IN_FLIGHT),
         "--structured-outputs-compile-timeout", "5", "--enable-lora", "--allow-runtime-lora"]
SEEN: dict[int, int] = {}

# What no schema generates: text that is not Unicode (lone surrogates, sent as the \udXXX
# escapes json.dumps writes), NUL, a string longer than any context, nesting beyond the
# server's bound, and the NaN/Infinity literals json.dumps writes for those floats.
HOSTILE_TEXT = ["\ud800", "a\udfffb", "\udbff\udbff", "\x00", "nul\x00inside", "x" * 200_000]


def _nested(depth: int, leaf: Any) -> Any:
    for k in range(depth):
        leaf = [leaf] if k % 2 else {"a": leaf}
    return leaf


HOSTILE = (st.sampled_from(HOSTILE_TEXT)
           | st.sampled_from([float("nan"), float("inf"), float("-inf")])
           | st.sampled_from([_nested(40, "deep"), _nested(20, "\ud800")]))


def _slots(value: Any) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """(container, key) of every string in ``value``, and of every value at all."""
    strings: list[tuple[Any, Any]] = []
    values: list[tuple[Any, Any]] = []
    stack = [value]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for key, child in items:
            values.append((node, key))
            if isinstance(child, str):
                strings.append((node, key))
            stack.append(child)
    return strings, values


def _upload(draw: st.DrawFn, body: dict[str, Any]) -> tuple[bytes, str]:
    """A multipart upload whose purpose may be hostile and whose file is one batch line of
    ``body``; its text is decoded as "unicode_escape", which spells a lone surrogate as JSON
    does: (form bytes, Content-Type)."""
    purpose = draw(st.sampled_from(["batch", *HOSTILE_TEXT]))
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body})
    form = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
            + line.encode("ascii") + b'\r\n--b\r\nContent-Disposition: form-data; '
            b'name="purpose"\r\n\r\n' + purpose.encode("unicode_escape") + b"\r\n--b--\r\n")
    return form, "multipart/form-data; boundary=b; charset=unicode_escape"


@st.composite
def hostile_bodies(draw: st.DrawFn, op: schemathesis.APIOperation) -> tuple[str, bytes, str]:
    """A valid body of ``op`` with one to three of its values (strings most often) made
    hostile, maybe a hostile field name, streamed or not: (path, JSON bytes, Content-Type)."""
    case = draw(op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    if op.path == UPLOAD:
        line = {"messages": [{"role": "user", "content": draw(HOSTILE)}], "max_tokens": 2}
        return (op.path, *_upload(draw, line))
    body = copy.deepcopy(case.body) if isinstance(case.body, dict) else {}
    for _ in range(draw(st.integers(1, 3))):
        strings, values = _slots(body)
        slots = strings if strings and draw(st.integers(0, 2)) else values
        if not slots:
            break
        node, key = draw(st.sampled_from(slots))
        node[key] = copy.deepcopy(draw(HOSTILE))  # the constants stay as they are
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.sampled_from(HOSTILE_TEXT[:3]))] = "x"
    if op.path in STREAMING:
        body["stream"] = draw(st.booleans())
    return case.formatted_path, json.dumps(body).encode(), "application/json"


@pytest.fixture(scope="module")
def fuzzed(start_server, tmp_path_factory):
    return start_server(FLAGS + ["--lora-root", str(tmp_path_factory.mktemp("adapters")),
                                 "--batch-dir", str(tmp_path_factory.mktemp("batches"))])


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
            elif response.status_code >= 400:  # Ollama's shape
                err = response.json()
                assert set(err) == {"error"} and isinstance(err["error"], str), err

        call()


def test_hostile_values_get_no_5xx_on_any_post_route(fuzzed) -> None:
    operations = [op for op in _operations(fuzzed.base_url) if op.method.upper() == "POST"]
    assert {op.path for op in operations} == POST_ENDPOINTS
    seen: dict[int, int] = {}
    with httpx.Client(base_url=fuzzed.base_url, timeout=60,
                      headers={"content-type": "application/json"}) as http:
        for op in operations:

            @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(hostile_bodies(op))
            def call(request: tuple[str, bytes, str]) -> None:
                path, body, content_type = request
                response = http.post(path, content=body,  # a dropped connection raises
                                     headers={"content-type": content_type})
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                SEEN[response.status_code] = SEEN.get(response.status_code, 0) + 1
                assert response.status_code < 500, (body[:300], response.text[:500])
                if response.status_code >= 400 and path == "/v1/messages":
                    assert response.json()["type"] == "error", response.text[:300]
                elif response.status_code >= 400 and path.startswith("/api/"):
                    err = response.json()  # Ollama's shape
                    assert set(err) == {"error"} and isinstance(err["error"], str), err
                elif response.status_code >= 400:
                    err = response.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, err
                else:
                    assert "internal error" not in response.text, response.text[:500]

            call()
    assert sum(n for s, n in seen.items() if 400 <= s < 500) > 0, seen
    assert sum(seen.values()) >= len(POST_ENDPOINTS) * HOSTILE_EXAMPLES // 2, seen


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
