"""Tool-call parsing per chat-template family, the fallback prompt for templates without tool
support, and streaming: however the reply is cut into deltas, the streamed content and calls
equal the whole reply's."""

from __future__ import annotations

import json

import pytest

from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.tool_parsers import (
    ToolCall,
    parse_llama3,
    parse_tagged,
    template_family,
)
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}
QWEN_TEMPLATE = "{% if tools %}<tools>{% endif %}<tool_call>{{ '<|im_start|>' }}"
LLAMA_TEMPLATE = "{% if tools %}Environment: ipython{% endif %}<|python_tag|><|eot_id|>"


def test_families_from_templates() -> None:
    assert template_family(QWEN_TEMPLATE) == "hermes"
    assert template_family(LLAMA_TEMPLATE) == "llama3"
    assert template_family("{{ '<|im_start|>' }}") == "smollm2"
    assert template_family(None) == "smollm2"


@pytest.mark.parametrize(("parse", "text", "content", "calls"), [
    (parse_tagged, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     "Sure.", [ToolCall("f", '{"x": 1}')]),
    (parse_tagged, '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', None,
     [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")]),
    (parse_tagged, '<tool_call>[{"name": "f", "arguments": {"x": 2}}, '
     '{"name": "g", "arguments": "{\\"y\\": 3}"}]</tool_call>', None,
     [ToolCall("f", '{"x": 2}'), ToolCall("g", '{"y": 3}')]),
    (parse_tagged, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (parse_tagged, "Just an answer.", "Just an answer.", []),
    (parse_llama3, '{"name": "f", "parameters": {"x": 1}}', None, [ToolCall("f", '{"x": 1}')]),
    (parse_llama3, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
     '{"name": "g", "parameters": {}}', None, [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")]),
    (parse_llama3, '{"not": "a call"}', '{"not": "a call"}', []),
    (parse_llama3, "Paris is sunny.", "Paris is sunny.", []),
])
def test_parsers(parse, text, content, calls) -> None:
    assert parse(text) == (content, calls)


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kwargs)


def test_fallback_renders_tools_into_the_system_message() -> None:
    mode = ToolMode.of(request(tools=[TOOL]), "{{ '<|im_start|>' }}")
    history = [{"role": "system", "content": "Be brief."},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "1", "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    messages, template_tools = mode.prompt_messages(history, "{{ '<|im_start|>' }}")
    assert template_tools is None
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert json.dumps(TOOL["function"]) in messages[0]["content"]
    assert messages[1]["content"] == '<tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>'
    messages, template_tools = mode.prompt_messages(history, QWEN_TEMPLATE)
    assert template_tools == [TOOL] and messages == history


def test_tool_choice_modes_and_their_constraints() -> None:
    assert ToolMode.of(request(tools=[TOOL], tool_choice="none"), None).constraint() is None
    assert ToolMode.of(request(tools=[TOOL]), None).kind == "auto"
    named = ToolMode.of(request(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "f"}}), None)
    assert named.constraint().json == TOOL["function"]["parameters"]
    required = ToolMode.of(request(tools=[TOOL], tool_choice="required"), None).constraint()
    assert required.json["items"]["anyOf"][0]["properties"]["name"] == {"const": "f"}
    with pytest.raises(ValueError, match="tool_choice needs 'tools'"):
        ToolMode.of(request(tool_choice="required"), None)


def _stream(mode: ToolMode, text: str, cuts: list[int]) -> tuple[str | None, list, bool]:
    stream = ToolStream(mode)
    deltas = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += stream.feed(text[a:b])
    tail, called = stream.finish()
    deltas += tail
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    return content, calls, called


@pytest.mark.parametrize(("template", "text"), [
    ("", 'Let me check. <tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>'),
    (QWEN_TEMPLATE, 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),
    (LLAMA_TEMPLATE, '{"name": "f", "parameters": {"x": 1}}'),
    ("", "No tool needed: <tool_ is not a call."),
])
def test_streamed_auto_replies_equal_whole_ones_for_every_cut(template, text) -> None:
    mode = ToolMode.of(request(tools=[TOOL]), template)
    content, calls = mode.parse(text)
    for cut in range(1, len(text)):
        got_content, got_calls, called = _stream(mode, text, [cut])
        assert (got_content.strip() if got_content else None) == content
        assert got_calls == [(c.name, c.arguments) for c in calls]
        assert called == bool(calls)
