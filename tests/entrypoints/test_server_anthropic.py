"""Anthropic's Messages API against a real `conveyor serve`, with the official ``anthropic``
client: a reply equals the chat completion of the same conversation, streamed and not; a tool
use round trip; errors in Anthropic's shape; ``x-api-key`` where keys are required."""

from __future__ import annotations

import anthropic
import httpx
import pytest

# this client no longer sends sampling fields itself; the server takes them as Anthropic's API did
GREEDY = {"temperature": 0.0}
SYSTEM = "You are a terse assistant."
QUESTION = "Name three colours."
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def _chat_reply(server, messages: list[dict], max_tokens: int) -> dict:
    resp = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_message_equals_the_chat_completion_of_the_same_conversation(server, client,
                                                                       model) -> None:
    msg = client.messages.create(model=model, system=SYSTEM, max_tokens=24, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": QUESTION}])
    chat = _chat_reply(server, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": QUESTION}], 24)
    assert msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat["choices"][0]["finish_reason"]]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]

    with client.messages.stream(model=model, system=[{"type": "text", "text": SYSTEM}],
                                max_tokens=24, extra_body=GREEDY,
                                messages=[{"role": "user", "content": [
                                    {"type": "text", "text": QUESTION}]}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds


def test_stop_sequences_end_the_reply(client, model) -> None:
    msg = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY,
                                 stop_sequences=[" "],
                                 messages=[{"role": "user", "content": "Say hello world"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == " "
    assert " " not in msg.content[0].text if msg.content else True


def test_a_tool_use_round_trip(client, model) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    msg = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY,
                                 tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[question])
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    with client.messages.stream(model=model, max_tokens=40, extra_body=GREEDY,
                                tools=[WEATHER], messages=[question],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    answer = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY,
                                    tools=[WEATHER], messages=[
        question,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                           "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 21 C"}]}])
    assert answer.content and answer.usage.output_tokens > 0


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}, "'image'"),
    ({"max_tokens": 4, "temperature": 3,
      "messages": [{"role": "user", "content": "hi"}]}, "temperature"),
    ({"max_tokens": 4, "tool_choice": {"type": "sometimes"},
      "messages": [{"role": "user", "content": "hi"}]}, "tool_choice"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]},
     "max_tokens"),
])
def test_bad_requests_get_anthropic_errors(server, model, body, fragment) -> None:
    resp = httpx.post(server.base_url + "/v1/messages", json={"model": model, **body},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert fragment in err["error"]["message"]


def test_the_client_sees_a_bad_request_error(client, model) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}])
    assert "tool_result" in str(info.value)


def test_x_api_key_is_accepted_where_keys_are_required(start_server, model) -> None:
    keyed = start_server(["--api-key", "sk-anthropic"])
    good = anthropic.Anthropic(base_url=keyed.base_url, api_key="sk-anthropic", max_retries=0)
    msg = good.messages.create(model=model, max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.output_tokens > 0
    bad = anthropic.Anthropic(base_url=keyed.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=2,
                            messages=[{"role": "user", "content": "hi"}])
