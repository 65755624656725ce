"""OpenAI's Responses API against a real `conveyor serve`, with the official ``openai`` client: a
response equals the chat completion of the same conversation, whole and streamed (the events in
order, numbered, their deltas joining to the final text); input items; a function call round
trip; a JSON-schema text format; ``store`` / ``previous_response_id`` refused (nothing is kept);
bad input a 400 in OpenAI's shape that stalls no other request."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0}
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colours."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
# the events of a reply that is one message, in order (the deltas repeat)
MESSAGE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done",
                  "response.output_item.done"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _chat(server, messages: list[dict], max_tokens: int, **extra) -> dict:
    resp = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": max_tokens, **GREEDY, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _collapsed(kinds: list[str]) -> list[str]:
    """Event types with runs of one type (deltas) collapsed to one."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


@pytest.mark.parametrize("max_output_tokens", [8, 64])
def test_a_response_equals_the_chat_completion_whole_and_streamed(server, client, model,
                                                                  max_output_tokens) -> None:
    r = client.responses.create(model=model, instructions=SYSTEM, input=QUESTION,
                                max_output_tokens=max_output_tokens, **GREEDY)
    chat = _chat(server, [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": QUESTION}], max_output_tokens)
    choice = chat["choices"][0]
    assert r.object == "response" and r.model == model
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == choice["message"]["content"]
    cut = choice["finish_reason"] == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == (
        "max_output_tokens" if cut else None)
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0

    events = list(client.responses.create(model=model, instructions=SYSTEM, input=QUESTION,
                                          max_output_tokens=max_output_tokens, stream=True,
                                          **GREEDY))
    kinds = [e.type for e in events]
    assert _collapsed(kinds) == MESSAGE_EVENTS + [f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == r.output_text
    assert final.status == r.status and final.usage.output_tokens == r.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_input_items_become_the_conversation(server, client, model) -> None:
    items = [{"role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"type": "message", "role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},  # left out of the prompt
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = client.responses.create(model=model, input=items, max_output_tokens=12, **GREEDY)
    chat = _chat(server, [{"role": "developer", "content": SYSTEM},
                          {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": QUESTION}], 12)
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_function_call_round_trip(client, model) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=model, input=[question], tools=[WEATHER],
                                tool_choice=forced, max_output_tokens=40, **GREEDY)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments).get("city"), str)

    events = list(client.responses.create(model=model, input=[question], tools=[WEATHER],
                                          tool_choice=forced, max_output_tokens=40,
                                          stream=True, **GREEDY))
    assert _collapsed([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    streamed = events[-1].response.output[0]
    assert deltas == streamed.arguments == call.arguments and streamed.name == call.name

    answer = client.responses.create(model=model, tools=[WEATHER], max_output_tokens=16,
                                     input=[question, call.model_dump(exclude_none=True),
                                            {"type": "function_call_output",
                                             "call_id": call.call_id, "output": "Sunny, 21 C"}],
                                     **GREEDY)
    assert answer.output and answer.usage.output_tokens > 0
    assert answer.usage.input_tokens > r.usage.input_tokens  # the call and its result are in


SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"},
                                           "hex": {"type": "string"}},
          "required": ["colour", "hex"], "additionalProperties": False}


def test_a_json_schema_text_format_constrains_the_output(client, model) -> None:
    r = client.responses.create(model=model, input="Give a colour and its hex code as JSON.",
                                max_output_tokens=60, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "colour",
                                                 "schema": SCHEMA, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=model, input="A colour as a JSON object.",
                                  max_output_tokens=8, text={"format": {"type": "json_object"}},
                                  **GREEDY)
    assert obj.output_text.startswith("{")  # constrained (and maybe cut short)


@pytest.mark.parametrize(("extra", "param"), [({"store": True}, "store"),
                                              ({"previous_response_id": "resp_1"},
                                               "previous_response_id")])
def test_kept_state_is_refused_with_a_clear_400(client, model, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="hi", max_output_tokens=2, **extra)
    assert info.value.body["param"] == param
    assert "keeps no responses" in info.value.body["message"]
    ok = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    assert ok.usage.output_tokens > 0


BAD = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": "hi"}] * 600}, "input"),  # > max_model_len 512
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_in_openais_shape(server, body, param) -> None:
    resp = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_bad_input_stalls_no_running_response(server, model) -> None:
    body = {"model": model, "input": QUESTION, "max_output_tokens": 48, "stream": True,
            "temperature": 0.0}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=120) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("event: response.created")
        started = time.monotonic()
        for bad, _ in BAD:
            assert httpx.post(server.base_url + "/v1/responses", json=bad,
                              timeout=30).status_code in (400, 404)
        assert time.monotonic() - started < 10
        rest = list(lines)
    assert any(line.startswith("event: response.") and line.endswith(("completed", "incomplete"))
               for line in rest)
