"""Random bodies against /v1/completions and /v1/chat/completions: whatever arrives, the answer is
never a 5xx, every 4xx is OpenAI's error JSON, and the server ends healthy and idle with every
KV block free. Bodies mix the real fields (with right and wrong types) and random JSON and
bytes; max_tokens and n stay small so that the valid ones finish quickly on a CPU."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from long_runs import sized

pytestmark = pytest.mark.timeout(sized(600, 3600))

EXAMPLES = sized(200, 3000)

# Strings with everything JSON can carry, lone surrogates included (escaped by json.dumps).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | any_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(any_text, inner, max_size=4), max_leaves=12)
# A wrong size, or a valid one too large to be quick, but never null or a few hundred, which
# would generate up to the context length and take long.
bad_sizes = json_values.filter(lambda v: v is not None and not (
    isinstance(v, int) and not isinstance(v, bool) and 3 < v <= 512))
small_sizes = st.integers(1, 3)

token_ids = st.lists(st.integers(-5, 60000) | st.integers(-2**64, 2**64), min_size=1, max_size=6)
prompts = any_text | token_ids | st.lists(any_text, min_size=1, max_size=3) \
    | st.lists(token_ids, min_size=1, max_size=3)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}), max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": any_text | parts},
                                          optional={"name": any_text}), min_size=1, max_size=3)
bools = st.booleans()

# field -> (a value of the right type, usually valid; a value of any type)
SHARED = {
    "max_tokens": (small_sizes, bad_sizes), "n": (small_sizes, bad_sizes),
    "model": (st.none(), json_values), "temperature": (st.floats(0, 2), json_values),
    "top_p": (st.floats(0, 1), json_values), "top_k": (st.integers(), json_values),
    "min_p": (st.floats(0, 1), json_values), "seed": (st.integers(), json_values),
    "stop": (any_text | st.lists(any_text, max_size=20), json_values),
    "stop_token_ids": (token_ids, json_values),
    "presence_penalty": (st.floats(-2, 2), json_values),
    "frequency_penalty": (st.floats(-2, 2), json_values),
    "repetition_penalty": (st.floats(0, 2), json_values),
    "min_tokens": (st.integers(0, 3) | st.integers(), json_values),
    "ignore_eos": (bools, json_values), "skip_special_tokens": (bools, json_values),
    "include_stop_str_in_output": (bools, json_values), "stream": (bools, json_values),
    "stream_options": (st.fixed_dictionaries({"include_usage": bools}), json_values),
    "user": (any_text, json_values), "priority": (st.just(0), json_values),
    "logit_bias": (st.just({}), json_values), "unknown_field": (json_values, json_values),
}
COMPLETION = {**SHARED, "prompt": (prompts, json_values),
              "logprobs": (st.integers(0, 5), json_values), "echo": (bools, json_values),
              "best_of": (st.none(), json_values), "suffix": (st.none(), json_values)}
CHAT = {**SHARED, "messages": (messages, json_values), "logprobs": (bools, json_values),
        "top_logprobs": (st.integers(0, 5), json_values),
        "add_generation_prompt": (bools, json_values),
        "max_completion_tokens": (small_sizes, bad_sizes)}


@st.composite
def request_objects(draw: st.DrawFn, fields: dict, required: tuple[str, ...]) -> dict:
    """The required fields and a few optional ones, right-typed, then one or two of them (maybe
    required ones) replaced by anything at all."""
    names = sorted(fields)
    obj = {name: draw(fields[name][0]) for name in required}
    for name in draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        obj[name] = draw(fields[name][0])
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        obj[name] = draw(fields[name][1])
    return obj


def bodies(fields: dict, required: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    objects = request_objects(fields, required).map(lambda obj: json.dumps(obj).encode())
    anything = json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
    return objects | objects | anything


requests = (st.tuples(st.just("/v1/completions"), bodies(COMPLETION, ("prompt", "max_tokens")))
            | st.tuples(st.just("/v1/chat/completions"),
                        bodies(CHAT, ("messages", "max_tokens"))))


def test_random_bodies_never_give_a_5xx(server) -> None:
    seen: dict[int, int] = {}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests)
        def post(request: tuple[str, bytes]) -> None:
            path, body = request
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (body, resp.text)
            if resp.status_code >= 400:
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
            elif "text/event-stream" in resp.headers["content-type"]:
                assert resp.text.rstrip().endswith("data: [DONE]"), resp.text
                assert '"server_error"' not in resp.text, (body, resp.text)

        post()
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if s >= 400) > 0, seen
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    for _ in range(100):
        m = server.metrics()
        if m["conveyor:num_requests_running"] == 0 and m["conveyor:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["conveyor:num_requests_running"] == 0
    assert m["conveyor:num_requests_waiting"] == 0
    assert m["conveyor:kv_cache_usage_perc"] == 0.0
    log = server.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "request failed" not in log  # app.py's 500 paths
    ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                    json={"prompt": "Still fine?", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
