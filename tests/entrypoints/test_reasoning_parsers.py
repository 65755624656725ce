"""The ``<think>`` reasoning parsers: a whole reply's split, the same split however the reply is
cut into streamed deltas (markers split across them), replies without markers, and reasoning
cut short before ``</think>``; ``conveyor serve`` refuses an unknown parser."""

from __future__ import annotations

import itertools

import pytest

from conveyor.entrypoints.cli import main
from conveyor.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningStream,
    split_reasoning,
)

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]


def _streamed(parser, deltas: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning, answer = "", ""
    for k, delta in enumerate(deltas):
        r, a = stream.feed(delta, last=k == len(deltas) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), [
    (QWEN3, "<think>\nTwo and two.\n</think>\n\n4", "Two and two.", "4"),
    (QWEN3, "  <think>a</think>b", "a", "b"),
    (QWEN3, "The answer is 4.", None, "The answer is 4."),  # no markers: all answer
    (QWEN3, " plain", None, " plain"),
    (QWEN3, "<think>still thinking when cut", "still thinking when cut", ""),  # unterminated
    (QWEN3, "<think></think>4", None, "4"),
    (QWEN3, "<thi", None, "<thi"),  # a marker's beginning that never completes
    (QWEN3, "4 </think> 5", None, "4 </think> 5"),  # an end marker without a start is text
    (R1, "Two and two.</think>4", "Two and two.", "4"),  # opened in the prompt
    (R1, "<think>Two and two.</think>4", "Two and two.", "4"),
    (R1, "still thinking when cut", "still thinking when cut", ""),  # no </think>: reasoning
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # only the first marker ends it
])
def test_a_whole_reply_is_split(parser, text, reasoning, answer) -> None:
    assert split_reasoning(parser, text) == (reasoning, answer)


def test_without_a_parser_everything_is_answer() -> None:
    assert split_reasoning(None, "<think>a</think>b") == (None, "<think>a</think>b")
    assert ReasoningStream(None).feed("<think>") == ("", "<think>")


@pytest.mark.parametrize(("parser", "text"), [
    (QWEN3, "<think>\nTwo plus two is four. </think>\n\n{\"answer\": 4}"),
    (QWEN3, "no reasoning, just <text> and </ends"),
    (QWEN3, "<think>cut short </thin"),
    (R1, "Two plus two </ is four.\n</think>4"),
    (R1, "<think>\nx</think>"),
])
def test_any_cut_into_deltas_gives_the_whole_split(parser, text) -> None:
    whole_reasoning, answer = split_reasoning(parser, text)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        deltas = [text[:i], text[i:j], text[j:]]
        assert _streamed(parser, deltas) == (whole_reasoning or "", answer), deltas


def test_a_marker_split_across_deltas_is_held_back_until_it_completes() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>I think") == ("I think", "")
    assert stream.feed(" so</th") == (" so", "")  # "</th" may begin the end marker
    assert stream.in_reasoning
    assert stream.feed("ink>\nYes") == ("", "Yes")
    assert not stream.in_reasoning
    assert stream.feed("</think>", last=True) == ("", "</think>")


def test_held_text_that_is_no_marker_is_sent_when_it_proves_not_to_be() -> None:
    stream = ReasoningStream(R1)
    assert stream.feed("a </") == ("a", "")
    assert stream.feed("b>") == (" </b>", "")
    assert stream.feed(" c", last=True) == (" c", "")


def test_serve_refuses_an_unknown_parser_before_the_model_loads(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--reasoning-parser", "nope"])
    assert info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
