"""Bodies the server refuses by size or shape before they cost anything: deep JSON nesting,
integer literals Python will not convert, ``NaN``/``Infinity`` (not JSON), fields no API of the
server has, too many or too long stop strings, oversized short fields, too many prompts or
tools, tools too long for the context, token ids outside the vocabulary. Each is a 400 in
OpenAI's shape, naming the field where there is one."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

DEEP = 20_000
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _tool(name: str, description: str = "", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters or {"type": "object"}}}

# (path, raw body, a fragment the message must contain, param)
CASES = [
    ("/v1/completions", b"[" * DEEP + b"]" * DEEP, "deeper than 32", None),
    ("/v1/chat/completions", b"[" * DEEP + b"]" * DEEP, "deeper than 32", None),
    ("/v1/completions", b'{"prompt": "hi", "extra": ' + b"[" * DEEP + b"]" * DEEP + b"}",
     "deeper than 32", None),
    ("/v1/completions", b'{"prompt": "hi", "extra": ' + b"[" * 40 + b"]" * 40 + b"}",
     "deeper than 32", None),
    ("/v1/chat/completions", b'{"messages": ' + b'[{"a": ' * 5000 + b"1" + b"}]" * 5000 + b"}",
     "deeper than 32", None),
    ("/v1/completions", json.dumps({"prompt": "x" * 8_000_000}).encode(), "8000000 characters",
     "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["hi", "y " * 100_000]}).encode(),
     "200000 characters", "prompt"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "z" * 50_000},
                                                      {"role": "user", "content": "z" * 50_000}]}
                                        ).encode(), "100000 characters", "messages"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "digits", None),
    ("/v1/completions", json.dumps({"prompt": [[1]] * 1025}).encode(), "at most 1024",
     "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["a"] * 2000}).encode(), "2000 prompts",
     "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 17}).encode(),
     "at most 16", "stop"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": "s" * 1025}).encode(),
     "at most 1024", "stop"),
    ("/v1/chat/completions", json.dumps({**CHAT, "stop": ["ok", "x" * 5000]}).encode(),
     "at most 1024", "stop"),
    ("/v1/completions", json.dumps({"prompt": "hi", "user": "u" * 1025}).encode(),
     "'user' has 1025 characters", "user"),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "m" * 2000}).encode(),
     "'model' has 2000 characters", "model"),
    ("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hi", "name": "n" * 1500}]}).encode(),
     "message's 'name'", "messages"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON value", None),
    ("/v1/chat/completions", b'{"messages": [], "top_p": -Infinity}',
     "-Infinity is not a JSON value", None),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_token": 5}).encode(),
     "'max_token' is not a field", "max_token"),
    ("/v1/chat/completions", json.dumps({**CHAT, "guided_json": {"type": "object"}}).encode(),
     "'guided_json' is not a field", "guided_json"),
    ("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hi", "image": "x"}]}).encode(),
     "'messages.0.image' is not a field", "messages"),
    ("/v1/embeddings", json.dumps({"input": "hi", "truncate": True}).encode(),
     "'truncate' is not a field", "truncate"),
    ("/v1/completions", json.dumps({"prompt": "hi", "allowed_token_ids": [1]}).encode(),
     "'allowed_token_ids' is not a field", "allowed_token_ids"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop_token_ids": [2, 49152]}).encode(),
     "outside the vocabulary [0, 49152): [49152]", "stop_token_ids"),
    ("/v1/chat/completions", json.dumps(
        {**CHAT, "tools": [_tool(f"f{i}") for i in range(129)]}).encode(),
     "--max-tools", "tools"),
    ("/v1/messages", json.dumps({"model": "m", "max_tokens": 2, "messages": CHAT["messages"],
                                 "tools": [{"name": f"f{i}", "input_schema": {}}
                                           for i in range(200)]}).encode(),
     "--max-tools", None),
    ("/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "i" * 50_000}]}).encode(),
     "characters are more than", "messages"),
    # 20 tools of 3,000 characters: more than the 512-token context can hold, found from their
    # characters before the template renders them
    ("/v1/chat/completions", json.dumps(
        {**CHAT, "tools": [_tool(f"f{i}", "d" * 3000) for i in range(20)]}).encode(),
     "characters are more than", "tools"),
]


@pytest.mark.parametrize(("path", "body", "fragment", "param"), CASES,
                         ids=[f"{i}-{c[0].removeprefix('/v1/')}" for i, c in enumerate(CASES)])
def test_refused_with_400(server, path, body, fragment, param) -> None:
    resp = httpx.post(server.base_url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert fragment in err["message"], err
    if path == "/v1/messages":  # Anthropic's shape: no param
        assert err["type"] == "invalid_request_error", err
        return
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_limits_leave_room_for_real_requests(server) -> None:
    """Each bound at its limit is served, with the fields of OpenAI's API that change nothing
    here (``metadata``, ``store``, ...) and tool schemas nested ten levels deep."""
    deep: dict = {"type": "string"}
    for _ in range(3):
        deep = {"type": "object", "properties": {"a": deep}}
    body = {**CHAT, "stop": ["x" * 1024] * 16, "user": "u" * 1024,
            "tools": [_tool(f"f{i}", parameters=deep) for i in range(128)],
            "tool_choice": "none", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
