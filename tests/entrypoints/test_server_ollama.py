"""Ollama's API against a real `conveyor serve`, with the unmodified ``ollama`` client: generate,
chat (whole and streamed, a tool round trip, a JSON-schema ``format``), embed, list, show and ps,
each answer equal to the same request through the OpenAI routes (greedy); errors in Ollama's
shape."""

from __future__ import annotations

import datetime
import json

import httpx
import ollama
import pytest

GREEDY = {"temperature": 0, "num_predict": 16}
QUESTION = "Name three colours."
SYSTEM = "You are a terse assistant."
# in the key order the ollama client sends a tool in, so that both routes render the same prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def _openai(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.base_url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _chat(server, messages: list[dict], max_tokens: int = 16, **extra) -> dict:
    return _openai(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})


def test_list_show_ps_and_version(client, model, server) -> None:
    (entry,) = client.list().models
    assert entry.model == model and entry.size > 0 and entry.details.family == "llama"
    assert entry.details.format == "gguf" and entry.details.parameter_size.endswith("M")
    info = client.show(model)
    assert "completion" in info.capabilities and "tools" in info.capabilities
    assert info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["llama.context_length"] == 512
    assert info.template and "{%" in info.template  # the model's chat template
    assert client.show(model + ":latest").modelinfo == info.modelinfo
    client.generate(model=model, keep_alive="1h")  # Ollama's load call: no prompt
    (running,) = client.ps().models
    assert running.model == model and running.context_length == 512
    left = running.expires_at - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(minutes=50) < left <= datetime.timedelta(hours=1)
    assert httpx.get(server.base_url + "/api/version", timeout=10).json()["version"]


def test_generate_equals_the_chat_completion_whole_and_streamed(client, model,
                                                                server) -> None:
    r = client.generate(model=model, prompt=QUESTION, system=SYSTEM, options=GREEDY)
    chat = _chat(server, [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": QUESTION}])
    assert r.response == chat["choices"][0]["message"]["content"] and r.done
    assert r.done_reason == chat["choices"][0]["finish_reason"]
    assert r.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert 0 < r.eval_count == chat["usage"]["completion_tokens"] <= 16
    parts = list(client.generate(model=model, prompt=QUESTION, system=SYSTEM, options=GREEDY,
                                 stream=True))
    assert "".join(p.response for p in parts) == r.response
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].done_reason, parts[-1].eval_count) == (r.done_reason, r.eval_count)


def test_raw_generate_equals_the_completion(client, model, server) -> None:
    prompt = "The capital of France is"
    r = client.generate(model=model, prompt=prompt, raw=True,
                        options={**GREEDY, "stop": ["."]})
    done = _openai(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                               "temperature": 0, "stop": ["."]})
    assert r.response == done["choices"][0]["text"]
    assert r.done_reason == done["choices"][0]["finish_reason"]


def test_chat_equals_the_chat_completion_whole_and_streamed(client, model, server) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = client.chat(model=model, messages=messages, options=GREEDY)
    chat = _chat(server, messages)
    assert r.message.role == "assistant"
    assert r.message.content == chat["choices"][0]["message"]["content"]
    assert (r.prompt_eval_count, r.eval_count) == (chat["usage"]["prompt_tokens"],
                                                   chat["usage"]["completion_tokens"])
    parts = list(client.chat(model=model, messages=messages, options=GREEDY, stream=True))
    assert len(parts) > 2 and "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].done_reason == r.done_reason
    assert r.done_reason == chat["choices"][0]["finish_reason"]


def test_a_tool_round_trip_equals_the_chat_completion(client, model, server) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    options = {"temperature": 0, "num_predict": 24}
    first = client.chat(model=model, messages=[question], tools=[WEATHER], options=options)
    chat = _chat(server, [question], 24, tools=[WEATHER])["choices"][0]["message"]
    assert first.message.content == (chat["content"] or "")
    assert [(c.function.name, dict(c.function.arguments)) for c in first.message.tool_calls or []] \
        == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in chat.get("tool_calls") or []]
    streamed = list(client.chat(model=model, messages=[question], tools=[WEATHER],
                                options=options, stream=True))
    assert "".join(p.message.content for p in streamed) == first.message.content
    # the call made and its result go back in the conversation
    history = [question,
               {"role": "assistant", "content": "",
                "tool_calls": [{"function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}]
    answer = client.chat(model=model, messages=history, tools=[WEATHER], options=options)
    chat = _chat(server, [question,
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": "call_1_0", "type": "function", "function": {
                                  "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                          {"role": "tool", "content": "Sunny, 21 C", "name": "get_weather"}],
                 24, tools=[WEATHER])
    assert answer.message.content == chat["choices"][0]["message"]["content"]
    assert answer.prompt_eval_count == chat["usage"]["prompt_tokens"]
    assert answer.prompt_eval_count > first.prompt_eval_count  # the call and result are in it


def test_a_json_schema_format_constrains_the_reply(client, model, server) -> None:
    messages = [{"role": "user", "content": "Give a person's name and age."}]
    options = {"temperature": 0, "num_predict": 60}
    r = client.chat(model=model, messages=messages, format=PERSON, options=options)
    person = json.loads(r.message.content)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    chat = _chat(server, messages, 60, response_format={
        "type": "json_schema", "json_schema": {"name": "format", "schema": PERSON}})
    assert r.message.content == chat["choices"][0]["message"]["content"]
    parts = list(client.chat(model=model, messages=messages, format=PERSON, options=options,
                             stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    generated = client.generate(model=model, prompt=messages[0]["content"], format="json",
                                options=options)
    assert isinstance(json.loads(generated.response), dict)


def test_embed_equals_the_embeddings_route(client, model, server) -> None:
    texts = ["The sky is blue.", "Grass is green."]
    r = client.embed(model=model, input=texts)
    ref = _openai(server, "/v1/embeddings", {"input": texts, "normalize": True})
    assert len(r.embeddings) == 2
    for got, want in zip(r.embeddings, ref["data"], strict=True):
        assert got == pytest.approx(want["embedding"], abs=1e-6)
    assert r.prompt_eval_count == ref["usage"]["prompt_tokens"]
    one = client.embed(model=model, input=texts[0])
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-6)
    legacy = client.embeddings(model=model, prompt=texts[1])
    assert legacy.embedding == pytest.approx(r.embeddings[1], abs=1e-6)
    long = client.embed(model=model, input="word " * 2000)  # truncated to the context
    assert len(long.embeddings[0]) == len(r.embeddings[0]) and long.prompt_eval_count == 512
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=model, input="word " * 2000, truncate=False)
    assert info.value.status_code == 400 and "context length" in info.value.error


@pytest.mark.parametrize(("path", "body", "status", "fragment"), [
    ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "model 'nope' not found"),
    ("/api/chat", {"model": None, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "model"),
    ("/api/chat", {"messages": [], "stream": False}, 400, "messages"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}],
                   "options": {"temperature": "hot"}}, 400, "options"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, 400,
     "images"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "think": True}, 400,
     "does not support thinking"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}, 400,
     "format"),
    ("/api/generate", {"prompt": "hi", "keep_alive": "soon"}, 400, "keep_alive"),
    ("/api/generate", {"prompt": "hi", "context": [1, 2, 3]}, 400, "context"),
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": 100000}}, 400,
     "context length"),
    ("/api/show", {"model": "nope"}, 404, "not found"),
])
def test_bad_requests_get_ollama_errors(server, model, path, body, status, fragment) -> None:
    body = {k: v for k, v in {"model": model, **body}.items() if v is not None}
    resp = httpx.post(server.base_url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and fragment in resp.json()["error"], resp.json()


def test_the_client_raises_response_errors(client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="missing:7b", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "missing:7b" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        list(client.chat(model="missing:7b", messages=[{"role": "user", "content": "hi"}],
                         stream=True))
    assert info.value.status_code == 404


CALL = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                         "parameters": {"type": "object", "required": ["city"],
                                                        "properties": {"city": {"type": "string"}}}},
        "required": ["name", "parameters"]}


@pytest.mark.slow
def test_a_call_the_model_makes_comes_back_as_ollama_tool_calls(start_server, model) -> None:
    """Under --tool-call-parser llama3 a reply that is a {"name", "parameters"} object is a call:
    a JSON-schema format makes the model write one, and the ollama client gets it as
    ``tool_calls`` (whole and streamed), equal to the OpenAI route's."""
    server = start_server(["--tool-call-parser", "llama3"])
    client = ollama.Client(host=server.base_url, timeout=120)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    options = {"temperature": 0, "num_predict": 40}
    r = client.chat(model=model, messages=[question], tools=[WEATHER], format=CALL,
                    options=options)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    assert r.done_reason == "stop" and not r.message.content
    chat = _chat(server, [question], 40, tools=[WEATHER], response_format={
        "type": "json_schema", "json_schema": {"name": "format", "schema": CALL}})
    (openai_call,) = chat["choices"][0]["message"]["tool_calls"]
    assert json.loads(openai_call["function"]["arguments"]) == dict(call.function.arguments)
    parts = list(client.chat(model=model, messages=[question], tools=[WEATHER], format=CALL,
                             options=options, stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(call.function.name, dict(call.function.arguments))]
    answer = client.chat(model=model, tools=[WEATHER], options=options, messages=[
        question, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}])
    assert answer.message.content and not answer.message.tool_calls
