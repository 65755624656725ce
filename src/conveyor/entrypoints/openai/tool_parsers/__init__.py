"""Tool calls in a model's text, one parser per format (``--tool-call-parser``, or the format
the chat template shows): each module documents its format.

* ``hermes``, ``smollm2``, ``llama3``, ``mistral``: JSON objects (``json_calls``);
* ``pythonic`` (Llama 3.2, Llama 4): a Python list of calls (``pythonic``);
* ``qwen3_coder``: XML (``qwen3_coder``);
* ``deepseek_v3``: DeepSeek's tool-call tokens (``deepseek``);
* ``gpt_oss``: harmony messages addressed to a function (``harmony``).

A parser takes the reply's text and the request's tools and returns the content (the text
outside the calls; None when empty) and the calls; text that does not parse as a call stays
content. ``CALL_MARKERS`` are the texts that open a call in each format: a stream sends the
text before them as it comes and holds the rest until the reply ends.
"""

from __future__ import annotations

from conveyor.entrypoints.openai.tool_parsers.base import Parser, ToolCall
from conveyor.entrypoints.openai.tool_parsers.deepseek import (
    CALL_BEGIN,
    CALLS_BEGIN,
    parse_deepseek_v3,
)
from conveyor.entrypoints.openai.tool_parsers.harmony import CHANNEL, START, parse_harmony
from conveyor.entrypoints.openai.tool_parsers.json_calls import (
    MISTRAL_CALLS,
    PYTHON_TAG,
    parse_llama3,
    parse_mistral,
    parse_tagged,
)
from conveyor.entrypoints.openai.tool_parsers.pythonic import PYTHON_START, parse_pythonic
from conveyor.entrypoints.openai.tool_parsers.qwen3_coder import parse_qwen3_coder

__all__ = ["CALL_MARKERS", "PARSERS", "Parser", "ToolCall", "parse_deepseek_v3",
           "parse_harmony", "parse_llama3", "parse_mistral", "parse_pythonic",
           "parse_qwen3_coder", "parse_tagged", "template_family"]

PARSERS: dict[str, Parser] = {
    "hermes": parse_tagged, "smollm2": parse_tagged, "llama3": parse_llama3,
    "mistral": parse_mistral, "pythonic": parse_pythonic, "qwen3_coder": parse_qwen3_coder,
    "deepseek_v3": parse_deepseek_v3, "gpt_oss": parse_harmony}
# llama3: the reply itself starts with "{"; pythonic: a list of calls opens with "[".
CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",), "smollm2": ("<tool_call>",), "llama3": (PYTHON_TAG, "{"),
    "mistral": (MISTRAL_CALLS,), "pythonic": (PYTHON_START, "["),
    "qwen3_coder": ("<tool_call>", "<function="), "deepseek_v3": (CALLS_BEGIN, CALL_BEGIN),
    "gpt_oss": (CHANNEL, START)}


def template_family(chat_template: str | None) -> str:
    """Which format a chat template's model calls tools in (smollm2 for templates without
    tool support: the fallback prompt asks for that format)."""
    template = chat_template or ""
    if CHANNEL in template:
        return "gpt_oss"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if MISTRAL_CALLS in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if PYTHON_START in template or "func_name1(" in template:
        return "pythonic"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    if "<tool_call>" in template and "tools" in template:
        return "hermes"
    return "smollm2"
