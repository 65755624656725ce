"""Structured outputs and tool calling through the official openai client against `conveyor
serve` on the real SmolLM2: response_format (json_schema for a dozen schemas, json_object),
vLLM's structured_outputs field (regex, choice, grammar), named and required tool calls,
streamed equal to non-streamed at temperature 0, and bad constraints as 400s."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(600)

CASES = json.loads((Path(__file__).parents[1] / "structured_outputs" / "schemas.json")
                   .read_text())["cases"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=None, messages=messages, temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 120), **kwargs)


def streamed(client, messages, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as {name, arguments}, finish_reason) reassembled from a stream."""
    content, calls, finish = None, {}, None
    for event in chat(client, messages, stream=True, **kwargs):
        choice = event.choices[0]
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function.name:
                entry["name"] += call.function.name
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def whole(response) -> tuple[str | None, list[dict], str]:
    choice = response.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason


def test_a_dozen_json_schemas_through_response_format(client) -> None:
    def ask(case):
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": case["schema"]}}
        return chat(client, [{"role": "user", "content": case["prompt"]}], response_format=fmt)

    with ThreadPoolExecutor(len(CASES)) as pool:
        responses = list(pool.map(ask, CASES))
    for case, response in zip(CASES, responses, strict=True):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), case["schema"])


def test_json_object_and_streamed_equals_whole(client) -> None:
    # a prompt whose greedy object closes in a few tokens in every dtype (an open-ended one can
    # loop inside a string value, on this small model, until max_tokens)
    messages = [{"role": "user", "content": 'Pick a colour. Answer in JSON with one key, "colour".'}]
    response = chat(client, messages, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": CASES[8]["schema"]}}
    messages = [{"role": "user", "content": CASES[8]["prompt"]}]
    assert streamed(client, messages, response_format=fmt) == whole(
        chat(client, messages, response_format=fmt))


def test_structured_outputs_field_on_completions_and_chat(client) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    text = client.completions.create(model=None, prompt="My phone number is", max_tokens=20,
                                     temperature=0,
                                     extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, text.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    response = chat(client, [{"role": "user", "content": "Sentiment of: I love this film!"}],
                    extra_body={"structured_outputs": {"choice": choices}})
    assert response.choices[0].message.content in choices
    response = chat(client, ASK, extra_body={"structured_outputs": {
        "grammar": 'root ::= "It is " ("sunny" | "rainy") "."'}})
    assert re.fullmatch(r"It is (sunny|rainy)\.", response.choices[0].message.content)


@pytest.mark.parametrize(("body", "reason"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema is required"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "cannot be compiled: EBNF parser error"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "cannot be compiled: Regex parsing error"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "needs exactly one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
])
def test_bad_constraints_are_400_with_the_reason(client, body, reason) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, ASK, extra_body=body)
    assert reason in info.value.message


def test_a_bad_grammar_does_not_disturb_the_requests_beside_it(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": CASES[0]["schema"]}}
    messages = [{"role": "user", "content": CASES[0]["prompt"]}]
    alone = chat(client, messages, response_format=fmt).choices[0].message.content

    def good(_):
        return chat(client, messages, response_format=fmt).choices[0].message.content

    def bad(_):
        with pytest.raises(openai.BadRequestError):
            chat(client, ASK, extra_body={"structured_outputs": {"grammar": "root ::= ("}})
        return "rejected"

    with ThreadPoolExecutor(4) as pool:
        got = [pool.submit(f, i) for i, f in enumerate([good, bad, good, bad])]
        assert [g.result() for g in got] == [alone, "rejected", alone, "rejected"]


def test_named_tool_call_streamed_and_whole(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = chat(client, ASK, tools=[WEATHER, TIME], tool_choice=named)
    content, calls, finish = whole(response)
    assert finish == "tool_calls" and content is None
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    assert response.choices[0].message.tool_calls[0].id.startswith("call_")
    assert streamed(client, ASK, tools=[WEATHER, TIME], tool_choice=named) == (
        content, calls, finish)


def test_required_tool_call_streamed_and_whole(client) -> None:
    content, calls, finish = whole(chat(client, ASK, tools=[WEATHER, TIME],
                                        tool_choice="required"))
    assert finish == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert streamed(client, ASK, tools=[WEATHER, TIME], tool_choice="required") == (
        content, calls, finish)


def test_auto_and_none_tool_choice_streamed_equal_whole(client) -> None:
    for choice in ("auto", "none"):
        got = whole(chat(client, ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40))
        assert got[2] in ("stop", "length", "tool_calls")
        assert (got[2] == "tool_calls") == bool(got[1])
        assert streamed(client, ASK, tools=[WEATHER], tool_choice=choice, max_tokens=40) == got
