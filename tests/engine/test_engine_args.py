"""EngineArgs' scheduler choices: strings from the command line or user code become enum members
once, where EngineArgs is built; a bad one is refused naming the valid ones."""

from __future__ import annotations

import argparse

import pytest

from conveyor.core.config import PreemptionMode, QueueOrder, SchedulingPolicy
from conveyor.engine.args import EngineArgs, add_cli_args, from_cli_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor")
    add_cli_args(parser)
    return parser


def test_choice_flags_become_enum_members():
    ns = _parser().parse_args(["--policy", "chunked", "--queue", "priority",
                               "--preemption-mode", "swap"])
    args = from_cli_args(ns)
    assert args.policy is SchedulingPolicy.CHUNKED
    assert args.queue is QueueOrder.PRIORITY
    assert args.preemption_mode is PreemptionMode.SWAP
    defaults = from_cli_args(_parser().parse_args([]))
    assert defaults.policy is SchedulingPolicy.PREFILL_FIRST
    assert defaults.queue is QueueOrder.FCFS
    assert defaults.preemption_mode is PreemptionMode.RECOMPUTE


def test_strings_from_user_code_become_enum_members():
    args = EngineArgs(policy="chunked", queue="priority")
    assert (args.policy, args.queue) == (SchedulingPolicy.CHUNKED, QueueOrder.PRIORITY)
    assert args.replace(preemption_mode="swap").preemption_mode is PreemptionMode.SWAP


def test_a_bad_choice_flag_is_an_argparse_error_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--policy", "fastest"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --policy: invalid choice: 'fastest'" in err
    assert "prefill_first" in err and "chunked" in err


def test_a_bad_choice_in_user_code_names_the_valid_ones():
    with pytest.raises(ValueError, match="queue must be one of 'fcfs', 'priority', got 'lifo'"):
        EngineArgs(queue="lifo")


def test_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "scheduling policy: prefill_first, chunked (default: prefill_first)" in help_text
    assert "recompute, swap (default: recompute)" in help_text
