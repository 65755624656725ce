"""chat_multiturn: the seeded conversations (every turn's prompt extends the previous one), the
working set it is sized by, its shape flag, and a tiny run against a spawned server."""

from __future__ import annotations

import argparse
import json

import pytest

from conveyor.bench.chat_run import offload_hits_from_metrics
from conveyor.bench.chat_workload import ChatSpec, make_chat_workload, parse_chat_spec
from conveyor.bench.serving import add_parser, spawn_variants
from conveyor.entrypoints.cli import main as cli_main

SMALL = ChatSpec(num_conversations=5, turns=(2, 4), system_len=40, user_len=(5, 9), reply_len=3)


def test_the_workload_is_seeded_and_each_turn_extends_the_last() -> None:
    a = make_chat_workload(1000, seed=3, spec=SMALL)
    assert a == make_chat_workload(1000, seed=3, spec=SMALL)
    assert a != make_chat_workload(1000, seed=4, spec=SMALL)
    assert len(a.conversations) == 5
    system = a.conversations[0].system
    assert len(system) == 40 and all(256 <= t < 1000 for t in system)
    for conv in a.conversations:
        assert conv.system == system and 2 <= len(conv.turns) <= 4
        for k, turn in enumerate(conv.turns):
            p = conv.prompt(k)
            assert 5 <= len(turn.user) <= 9 and len(turn.reply) == 3
            assert p[-len(turn.user):] == turn.user
            if k:
                prev = conv.turns[k - 1]
                assert p[:-len(turn.user)] == conv.prompt(k - 1) + prev.reply
    assert a.num_requests == sum(len(c.turns) for c in a.conversations)
    assert a.max_seq_len == max(len(c.prompt(len(c.turns) - 1)) + 3 for c in a.conversations)


def test_the_working_set_counts_the_system_prompt_once() -> None:
    w = make_chat_workload(1000, seed=0, spec=SMALL)
    own = [sum(len(t.user) + 3 for t in c.turns) for c in w.conversations]
    assert w.working_set_tokens == 40 + sum(own)
    # blocks of 8: the 5 shared full blocks, then each conversation's full blocks past them
    assert w.working_set_blocks(8) == 5 + sum((40 + o) // 8 - 5 for o in own)
    assert "5 conversations" in w.describe(8, 10) and "x a 10-block pool" in w.describe(8, 10)


def test_the_defaults_outgrow_prefix_affinitys_window_and_a_small_pool() -> None:
    w = make_chat_workload(49152, seed=0)
    assert w.spec.system_len // 16 > 64  # prefix_affinity hashes 64 blocks of 16
    assert w.working_set_blocks(16) > 8 * 320
    assert w.max_seq_len <= 4096


def test_the_shape_flag() -> None:
    spec = parse_chat_spec("turns=2-3, system_len=64,reply_len=8,user_len=16")
    assert (spec.turns, spec.system_len, spec.reply_len, spec.user_len) == ((2, 3), 64, 8,
                                                                           (16, 16))
    assert parse_chat_spec(None) == ChatSpec()
    for bad, message in [("turns", "KEY=VALUE"), ("color=3", "KEY=VALUE"),
                         ("reply_len=x", "integer"), ("turns=3-1", "range"),
                         ("num_conversations=0", ">= 1")]:
        with pytest.raises(ValueError, match=message):
            parse_chat_spec(bad)


def test_offload_variants_multiply_the_servers() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--spawn", "--kv-offload-variants", "0,1048576"])
    assert spawn_variants(args) == [
        ("conveyor offload=off", ["--kv-offload-cpu-bytes", "0"]),
        ("conveyor offload=1048576", ["--kv-offload-cpu-bytes", "1048576"])]
    fleet = parser.parse_args(["serve", "--spawn", "--data-parallel-size", "2", "--router",
                               "kv_aware,round_robin", "--kv-offload-variants", "0"])
    assert [label for label, _ in spawn_variants(fleet)] == [
        "conveyor dp2 kv_aware offload=off", "conveyor dp2 round_robin offload=off"]
    with pytest.raises(ValueError, match="byte counts"):
        spawn_variants(parser.parse_args(["serve", "--kv-offload-variants", "-1"]))


def test_offload_hits_are_summed_over_tiers_and_replicas() -> None:
    page = ('conveyor:kv_offload_hits_total{replica="a",tier="cpu"} 32.0\n'
            'conveyor:kv_offload_hits_total{replica="b",tier="disk"} 16.0\n'
            "conveyor:prefix_cache_hits_total 5.0\n")
    assert offload_hits_from_metrics(page) == 48.0
    assert offload_hits_from_metrics("conveyor:prefix_cache_hits_total 5.0") is None


@pytest.mark.slow
def test_a_tiny_chat_run_against_a_spawned_server(tmp_path, capsys) -> None:
    out = tmp_path / "chat.json"
    rc = cli_main(["bench", "serve", "--spawn", "--workload", "chat_multiturn",
                   "--chat-spec", "num_conversations=3,turns=2-3,system_len=64,user_len=16-24,"
                   "reply_len=4", "--max-concurrency", "2", "--json", str(out),
                   "--max-model-len", "512", "--num-gpu-blocks", "64", "--max-num-seqs", "4",
                   "--kv-offload-variants", "0,4194304",
                   "--server-log", str(tmp_path / "server.log")])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["conveyor offload=off", "conveyor offload=4194304"]
    for r in runs:
        assert r["workload"] == "chat_multiturn" and r["completed"] == r["sent"] >= 6
        assert r["prefix_hit_rate"] > 0.3  # later turns find the conversation so far
        assert r["ttft"]["p99"] >= r["ttft"]["p50"] > 0 and r["tpot"]["mean"] > 0
    assert "offload_hit_rate" not in runs[0] and runs[1]["offload_hit_rate"] >= 0
    assert "| conveyor offload=off | inf |" in capsys.readouterr().out
