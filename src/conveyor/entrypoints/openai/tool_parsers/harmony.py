"""``gpt_oss`` tool calls (gpt-oss's harmony format). The reply is a run of messages,
``<|start|>assistant<|channel|>CHANNEL<|message|>TEXT`` ended by ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the first message's ``<|start|>assistant`` is in the prompt). A message whose
header names a recipient, ``to=functions.NAME`` (in the role part or after the channel, with
``<|constrain|>json`` optional), is a call whose text is the arguments object. The content is
the ``final`` channel's text, ``commentary`` preambles addressed to no one, and text outside any
message; ``analysis`` is the model's reasoning and is left out.

The markers are special tokens: the request keeps them in the text with
``skip_special_tokens: false`` (the chat template's model sees them either way)."""

from __future__ import annotations

import re
from typing import Any

from conveyor.entrypoints.openai.tool_parsers.base import ToolCall, arguments_json, content

START = "<|start|>"
CHANNEL = "<|channel|>"
_MESSAGE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<channel>[^<]*)"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL)
_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([\w.\-]+)")


def parse_harmony(text: str, tools: list[dict[str, Any]] | None = None
                  ) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    kept = []
    end = 0
    for m in _MESSAGE.finditer(text):
        kept.append(text[end:m.start()])
        end = m.end()
        header = (m.group("role") or "") + " " + m.group("channel")
        channel = m.group("channel").split()[0] if m.group("channel").split() else ""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            arguments = arguments_json(m.group("body").strip() or "{}")
            if arguments is not None:
                calls.append(ToolCall(recipient.group(1), arguments))
                continue
        if channel != "analysis":
            kept.append(m.group("body"))
    kept.append(text[end:])
    return (content("".join(kept)), calls) if calls else (content(text), [])
