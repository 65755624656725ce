"""The tool-call formats of Mistral, Llama 3.2/4 (pythonic), Qwen3-Coder (XML), DeepSeek-V3 and
gpt-oss (harmony): each format's fixture (several calls, nested JSON arguments, text before and
after) parses whole to the expected content and calls, and streamed one character at a time
(and cut at every point) to the same; each format is recognised from its chat template, and
text in a format that is not a call stays content."""

from __future__ import annotations

import json

import pytest

from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.tool_parsers import PARSERS, ToolCall, template_family
from conveyor.entrypoints.openai.tools import ToolMode, ToolStream

NESTED = {"city": "Paris", "filters": {"days": [1, 2], "units": {"temp": "C"}}, "exact": True}
WEATHER = ("get_weather", json.dumps(NESTED))
TIME = ("get_time", json.dumps({"zone": "CET"}))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "filters": {"type": "object"},
                                     "exact": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
NESTED_JSON = json.dumps(NESTED)
DS = {k: f"<｜{k}｜>" for k in ("tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin",
                                  "tool▁call▁end", "tool▁sep")}

# (parser, reply, content, calls)
FIXTURES = [
    ("mistral", f'Let me look. [TOOL_CALLS][{{"name": "get_weather", "arguments": {NESTED_JSON}}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}] Then I answer.',
     "Let me look.  Then I answer.", [WEATHER, TIME]),
    ("mistral", f"Let me look.[TOOL_CALLS]get_weather[ARGS]{NESTED_JSON}"
     '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"} Done.',
     "Let me look. Done.", [WEATHER, TIME]),
    ("pythonic", 'Checking both. [get_weather(city="Paris", filters={"days": [1, 2], '
     '"units": {"temp": "C"}}, exact=True), get_time(zone=\'CET\')] That is all.',
     "Checking both.  That is all.", [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", filters={"days": [1, 2], '
     '"units": {"temp": "C"}}, exact=true)]<|python_end|> and [get_time(zone="CET")] done',
     "and  done", [WEATHER, TIME]),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     '</parameter>\n<parameter=filters>\n{"days": [1, 2], "units": {"temp": "C"}}\n</parameter>\n'
     "<parameter=exact>\ntrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>\n"
     "Both sent.", "I will check.\n\n\nBoth sent.", [WEATHER, TIME]),
    ("deepseek_v3", f"Looking it up.{DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}function"
     f"{DS['tool▁sep']}get_weather\n```json\n{NESTED_JSON}\n```{DS['tool▁call▁end']}\n"
     f"{DS['tool▁call▁begin']}function{DS['tool▁sep']}get_time\n```json\n"
     f'{{"zone": "CET"}}\n```{DS["tool▁call▁end"]}{DS["tool▁calls▁end"]} Back soon.',
     "Looking it up. Back soon.", [WEATHER, TIME]),
    ("deepseek_v3", f"V3.1 style: {DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}get_weather"
     f"{DS['tool▁sep']}{NESTED_JSON}{DS['tool▁call▁end']}{DS['tool▁call▁begin']}get_time"
     f'{DS["tool▁sep"]}{{"zone": "CET"}}{DS["tool▁call▁end"]}{DS["tool▁calls▁end"]}ok',
     "V3.1 style: ok", [WEATHER, TIME]),
    ("gpt_oss", "<|channel|>analysis<|message|>Need weather and time.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     f"<|message|>{NESTED_JSON}<|call|>"
     "<|start|>assistant to=functions.get_time<|channel|>commentary json"
     '<|message|>{"zone": "CET"}<|call|>'
     "<|start|>assistant<|channel|>final<|message|> Results follow.<|return|>",
     "Checking now. Results follow.", [WEATHER, TIME]),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_whole_replies(parser, text, content, calls) -> None:
    got_content, got_calls = PARSERS[parser](text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == \
        [(n, json.loads(a)) for n, a in calls]


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kwargs)


def _stream(mode: ToolMode, pieces: list[str]) -> tuple[str | None, list, bool]:
    stream = ToolStream(mode)
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    tail, called = stream.finish()
    deltas += tail
    content = "".join(d.get("content") or "" for d in deltas) or None
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    return content, calls, called


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FIXTURES)
def test_streamed_one_character_at_a_time_and_cut_anywhere(parser, text, content,
                                                           calls) -> None:
    mode = ToolMode.of(request(tools=TOOLS), None, parser)
    whole = mode.parse(text)
    expected = (content, [(c.name, c.arguments) for c in whole[1]], True)
    got_content, got_calls, called = _stream(mode, list(text))
    assert ((got_content or "").strip() or None, got_calls, called) == expected
    for cut in range(1, len(text)):
        got_content, got_calls, called = _stream(mode, [text[:cut], text[cut:]])
        assert ((got_content or "").strip() or None, got_calls, called) == expected


def test_content_streams_before_the_call_starts() -> None:
    mode = ToolMode.of(request(tools=TOOLS), None, "mistral")
    stream = ToolStream(mode)
    assert stream.feed("Let me look. [TOOL") == [{"content": "Let me look. "}]
    assert stream.feed('_CALLS][{"name": "get_time", "arguments": {}}]') == []


@pytest.mark.parametrize(("parser", "text"), [
    ("mistral", "[TOOL_CALLS] not json"),
    ("pythonic", "The list [1, 2] and f(x) are not calls; [f(1)] has a positional argument."),
    ("qwen3_coder", "Use <function> tags."),
    ("deepseek_v3", f"{DS['tool▁calls▁begin']}{DS['tool▁call▁begin']}function{DS['tool▁sep']}"
     f"f\n```json\nnot json\n```{DS['tool▁call▁end']}{DS['tool▁calls▁end']}"),
    ("gpt_oss", "<|channel|>final<|message|>Plain answer.<|return|>"),
])
def test_text_that_is_not_a_call_stays_content(parser, text) -> None:
    assert PARSERS[parser](text, TOOLS) == (text.strip(), [])
    mode = ToolMode.of(request(tools=TOOLS), None, parser)
    assert _stream(mode, list(text)) == (text, [], False)


def test_qwen3_coder_types_follow_the_schema() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
              "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                             "ratio": {"type": ["number", "null"]}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n<parameter=n>\n7\n"
            "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=extra>\nhello world\n"
            "</parameter>\n</function>\n</tool_call>")
    _, calls = PARSERS["qwen3_coder"](text, tools)
    assert json.loads(calls[0].arguments) == {"code": "42", "n": 7, "ratio": 0.5,
                                              "extra": "hello world"}


@pytest.mark.parametrize(("template", "family"), [
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("Respond in the format [func_name1(params_name1=params_value1)]", "pythonic"),
    ("{{ '<|python_start|>' }}", "pythonic"),
    ("{% if tools %}<tool_call>\n<function=name>\n<parameter=p>{% endif %}", "qwen3_coder"),
    ("{{ '<｜tool▁calls▁begin｜>' }}", "deepseek_v3"),
    ("<|start|>assistant<|channel|>commentary<|constrain|>json", "gpt_oss"),
])
def test_formats_from_templates(template, family) -> None:
    assert template_family(template) == family
    assert ToolMode.of(request(tools=TOOLS), template).family == family
    assert ToolMode.of(request(tools=TOOLS), template, "hermes").family == "hermes"


def test_llama3_and_hermes_fixtures_keep_parsing() -> None:
    assert PARSERS["llama3"]('{"name": "f", "parameters": {"a": {"b": [1]}}}', None) == \
        (None, [ToolCall("f", '{"a": {"b": [1]}}')])


def test_the_serve_flag_names_a_parser() -> None:
    from conveyor.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--tool-call-parser", "qwen3_coder"])
    assert args.tool_call_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
