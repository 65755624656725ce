"""``--reasoning-parser`` against a real `conveyor serve`: SmolLM2, shown one turn that reasons in
``<think>...</think>`` and asked the same question again, copies that turn at temperature 0, and
the server splits the copy: ``reasoning_content`` in chat (whole and streamed), a ``reasoning``
item in the Responses API, a ``thinking`` block in Anthropic's Messages API; a JSON schema
constrains the answer only. ``deepseek_r1``: the reply starts inside the reasoning."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

QUESTION = {"role": "user", "content": "What is 2+2?"}
THOUGHT = "Two plus two is four."  # what the model writes, copying the shown turn


def _shown(answer: str, opening: str = "<think>") -> list[dict]:
    """A conversation that shows one reasoning turn, then asks the same question again."""
    return [{"role": "system", "content": "Think inside <think></think> first, then answer."},
            QUESTION, {"role": "assistant",
                       "content": f"{opening}Two plus two makes four.</think>{answer}"},
            QUESTION]


THINKING = _shown("4")
THINKING_JSON = _shown('{"answer": 4}')
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}


@pytest.fixture(scope="module")
def qwen3(start_server):
    # bf16 with float compute on every machine: SmolLM2's greedy copy of the shown turn, which
    # the checks read, opens with <think> there (float32 and integer compute leave it out)
    return start_server(["--reasoning-parser", "qwen3", "--dtype", "bfloat16",
                         "--weight-compute", "float"])


@pytest.fixture(scope="module")
def client(qwen3) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen3.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_chat_splits_reasoning_content_whole_and_streamed(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=THINKING, max_tokens=40,
                                       temperature=0.0)
    message = r.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == "4"
    chunks = list(client.chat.completions.create(model=model, messages=THINKING, max_tokens=40,
                                                 temperature=0.0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (THOUGHT, "4")
    assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1  # as it comes


def test_a_reply_without_reasoning_has_none(client, model) -> None:
    r = client.chat.completions.create(model=model, max_tokens=8, temperature=0.0,
                                       messages=[{"role": "user", "content": "Say hi."}])
    message = r.choices[0].message
    assert message.reasoning_content is None and message.content


def test_a_json_schema_constrains_the_answer_not_the_reasoning(client, model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = client.chat.completions.create(model=model, messages=THINKING_JSON, max_tokens=40,
                                       temperature=0.0, response_format=fmt)
    message = r.choices[0].message
    assert message.reasoning_content == THOUGHT  # free text before </think>
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"


def test_responses_have_a_reasoning_item(client, model) -> None:
    r = client.responses.create(model=model, input=THINKING, max_output_tokens=40,
                                temperature=0.0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == "4"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model=model, input=THINKING, max_output_tokens=40,
                                          temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (THOUGHT, "4")
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_messages_have_a_thinking_block(qwen3, model) -> None:
    client = anthropic.Anthropic(base_url=qwen3.base_url, api_key="unused", max_retries=0,
                                 timeout=120)
    system, *messages = THINKING
    greedy = {"temperature": 0.0}  # this client no longer sends sampling fields itself
    msg = client.messages.create(model=model, system=system["content"], messages=messages,
                                 max_tokens=40, extra_body=greedy)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == THOUGHT and msg.content[1].text == "4"
    with client.messages.stream(model=model, system=system["content"], messages=messages,
                                max_tokens=40, extra_body=greedy) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == "4"
    again = client.messages.create(model=model, max_tokens=4, extra_body=greedy, messages=[
        *messages[:-1], {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        messages[-1]])  # a thinking block sent back is left out of the prompt
    assert again.usage.output_tokens > 0


@pytest.mark.slow  # starts a server of its own
def test_deepseek_r1_replies_start_inside_the_reasoning(start_server, model) -> None:
    # the qwen3 fixture's dtype and compute, whose greedy copy of the shown turn the check reads
    r1 = start_server(["--reasoning-parser", "deepseek_r1", "--dtype", "bfloat16",
                       "--weight-compute", "float"])
    body = {"model": model, "messages": _shown("4", opening=""), "max_tokens": 40,
            "temperature": 0.0}
    resp = httpx.post(r1.base_url + "/v1/chat/completions", json=body, timeout=120)
    message = resp.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, "4")
