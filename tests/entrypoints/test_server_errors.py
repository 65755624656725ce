"""Bad requests get OpenAI-shaped errors with the right status and a useful message, and never
disturb a request that is running at the same time."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

LONG_PROMPT = "hello " * 600  # > max_model_len (512) tokens
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
DEEP_SCHEMA = '{"type": "array", "items": ' * 150 + '{"type": "string"}' + "}" * 150


def _earlier_call(function: object) -> bytes:
    """A chat request with tools whose assistant turn made a call with ``function``."""
    return json.dumps({"tools": [TOOL], "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "1", "content": "done"}]}).encode()


# (path, raw body, status, a fragment the message must contain, param)
CASES = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4', 400, "not valid JSON", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe hi"}', 400, "UTF-8", None),
    ("/v1/completions", b"", 400, "empty", None),
    ("/v1/completions", b"[1, 2, 3]", 400, "JSON object", None),
    ("/v1/completions", b'{"max_tokens": 4}', 400, "required", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "4"}', 400, "integer", "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "boolean", "stream"),
    ("/v1/completions", b'{"prompt": 42}', 400, "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 3.5}', 400, "2", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "greater than 0", "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "greater than or equal to 1",
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "greater than or equal to 1", "n"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 99}', 400, "20", "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "presence_penalty": -7}', 400, "-2",
     "presence_penalty"),
    ("/v1/completions", b'{"prompt": "hi", "min_tokens": 9, "max_tokens": 3}', 400,
     "max_tokens", "min_tokens"),
    ("/v1/completions", b'{"prompt": ""}', 400, "empty", "prompt"),
    ("/v1/completions", b'{"prompt": [99999999]}', 400, "vocabulary", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "priority": 5}', 400, "--queue priority", "priority"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4o"}', 404, "gpt-4o", "model"),
    ("/v1/completions", json.dumps({"prompt": LONG_PROMPT}).encode(), 400,
     "maximum context length is 512", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 600}', 400, "512", "max_tokens"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "at least one message", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400,
     "role", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400,
     "content", "messages"),
    ("/v1/chat/completions", b'{"messages": "hello"}', 400, "messages", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"model": "nope"}', 404, "nope", "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"top_logprobs": 2}', 400, "logprobs", "top_logprobs"),
    ("/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": LONG_PROMPT}]}).encode(), 400,
     "maximum context length", "messages"),
    ("/v1/nothing-here", b"{}", 404, "Not Found", None),
    # Inputs that once reached code that raised (a 500): a schema nested deeply inside a string,
    # an earlier tool call whose function is not an object or whose arguments are not text.
    ("/v1/completions", json.dumps({"prompt": "hi", "structured_outputs": {"json": DEEP_SCHEMA}})
     .encode(), 400, "nests deeper than", "structured_outputs"),
    ("/v1/chat/completions", _earlier_call("f"), 400, "tool_calls.0.function", "messages"),
    ("/v1/chat/completions", _earlier_call({"name": "f", "arguments": {"x": 1}}), 400,
     "tool_calls.0.function.arguments", "messages"),
    ("/v1/chat/completions", _earlier_call({"name": "f", "arguments": 5}), 400,
     "tool_calls.0.function.arguments", "messages"),
]


def _check(resp: httpx.Response, status: int, fragment: str, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_request(server, path, body, status, fragment, param) -> None:
    resp = httpx.post(server.base_url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"})
    _check(resp, status, fragment, param)


def test_bad_requests_do_not_disturb_a_running_stream(server) -> None:
    result: dict[str, object] = {}

    def stream() -> None:
        body = {"prompt": "Count slowly:", "max_tokens": 32, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                          timeout=240) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        result["status"] = resp.status_code
        result["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    for path, body, status, fragment, param in CASES:
        resp = httpx.post(server.base_url + path, content=body, timeout=60,
                          headers={"content-type": "application/json"})
        _check(resp, status, fragment, param)
    t.join(240)
    assert result["status"] == 200
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens": 32' in lines[-2]
    assert not any('"error"' in line for line in lines)
    ok = httpx.post(server.base_url + "/v1/completions",
                    json={"prompt": "Still there?", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_503_while_the_model_loads(server) -> None:
    loading = [r for r in server.startup_responses if r.status_code != 200]
    assert loading, "the model loads for seconds: /health must have answered before that"
    assert all(r.status_code == 503 for r in loading)
    err = loading[0].json()["error"]
    assert "loading" in err["message"] and err["type"] == "server_error"
    assert server.startup_responses[-1].status_code == 200
