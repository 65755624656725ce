"""The serving benchmark: arrivals, SLO/metrics parsing, and the client against a real server."""

import argparse
import json
import math
import statistics

import pytest

from conveyor.bench.serving import (
    RequestResult,
    add_parser,
    arrival_offsets,
    engine_flags,
    parse_rates,
    parse_slo,
    preemptions_from_metrics,
    prefix_cache_from_metrics,
    spawn_variants,
    summarize,
)
from conveyor.entrypoints.cli import main as cli_main


def test_poisson_arrivals_are_seeded_with_the_requested_mean_gap():
    a = arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=0)
    assert a == arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=0)
    assert a != arrival_offsets(2000, rate=4.0, burstiness=1.0, seed=1)
    gaps = [b - a_ for a_, b in zip(a, a[1:], strict=False)]
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)


def test_burstier_gamma_arrivals_vary_more():
    def cv(burstiness):
        a = arrival_offsets(3000, 4.0, burstiness, seed=0)
        gaps = [b - a_ for a_, b in zip(a, a[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert cv(0.25) > 1.5 > cv(1.0) > 0.8 > cv(4.0)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_fail():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError, match="request-rate"):
        parse_rates("0")
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0, 0)


def test_slo_parsing():
    assert parse_slo("ttft=0.5, tpot=0.1") == {"ttft": 0.5, "tpot": 0.1}
    assert parse_slo(None) == {}
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("latency=3")


def test_preemptions_are_read_from_conveyor_counters():
    page = "\n".join([
        "# HELP conveyor:num_preemptions_total Preemptions of running requests.",
        "# TYPE conveyor:num_preemptions_total counter",
        "conveyor:num_preemptions_total 7.0",
        "conveyor:num_preemptions_created 1.7e9",
        "conveyor:num_requests_running 3.0",
        "vllm:num_preemptions_total 99.0",
    ])
    assert preemptions_from_metrics(page) == 7.0
    assert preemptions_from_metrics("conveyor:num_requests_running 3.0") is None


def test_prefix_cache_is_summed_over_replicas():
    page = "\n".join([
        'conveyor:prefix_cache_hits_total{model_name="m",replica="a"} 30.0',
        'conveyor:prefix_cache_hits_total{model_name="m",replica="b"} 10.0',
        'conveyor:prefix_cache_queries_total{model_name="m",replica="a"} 50.0',
        'conveyor:prefix_cache_queries_total{model_name="m",replica="b"} 50.0',
        'conveyor:prefix_cache_hits_created{model_name="m",replica="a"} 1.7e9',
    ])
    assert prefix_cache_from_metrics(page) == (40.0, 100.0)
    assert prefix_cache_from_metrics("conveyor:num_requests_running 3.0") is None


def test_one_spawned_fleet_per_router():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--spawn", "--data-parallel-size", "2", "--router",
                              "prefix_affinity,round_robin", "--ray-num-cpus", "2"])
    variants = spawn_variants(args)
    assert [label for label, _ in variants] == ["conveyor dp2 prefix_affinity",
                                                "conveyor dp2 round_robin"]
    assert variants[1][1] == ["--data-parallel-size", "2", "--threads-per-replica", "1",
                              "--ray-num-cpus", "2", "--router", "round_robin"]
    single = parser.parse_args(["serve", "--spawn"])
    assert spawn_variants(single) == [("conveyor", [])]


def test_a_spawned_server_runs_the_scheduling_this_command_reports():
    """`conveyor serve` has scheduling defaults of its own (chunked): the benchmark passes its
    own, the offline engine's unless given, so its report names what the server ran."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    flags = engine_flags(parser.parse_args(["serve", "--spawn"]))
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {"--policy": "prefill_first", "--max-num-batched-tokens": "4096",
                     "--long-prefill-token-threshold": "0"}
    flags = engine_flags(parser.parse_args(["serve", "--spawn", "--policy", "chunked",
                                            "--max-num-batched-tokens", "256"]))
    assert flags[flags.index("--policy") + 1] == "chunked"
    assert flags[flags.index("--max-num-batched-tokens") + 1] == "256"


def test_pd_variants_spawn_a_disaggregated_fleet_beside_a_plain_one():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--spawn", "--data-parallel-size", "2",
                              "--pd-variants", "off,1:1", "--ray-num-cpus", "2"])
    variants = spawn_variants(args)
    assert [label for label, _ in variants] == ["conveyor dp2 prefix_affinity",
                                                "conveyor pd1:1 prefix_affinity"]
    assert variants[1][1] == ["--data-parallel-size", "2", "--pd", "1:1",
                              "--threads-per-replica", "1", "--ray-num-cpus", "2",
                              "--router", "prefix_affinity"]
    with pytest.raises(ValueError, match="bad --pd"):
        spawn_variants(parser.parse_args(["serve", "--spawn", "--pd-variants", "2"]))


def test_summary_goodput_counts_requests_within_every_slo():
    fast = RequestResult(True, 10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4)
    slow = RequestResult(True, 10, output_tokens=5, ttft=2.0, e2e=2.4, itl=[0.1] * 4)
    failed = RequestResult(False, 10, error="HTTP 500")
    s = summarize([fast, slow, failed], duration=2.0, slo={"ttft": 1.0})
    assert (s["sent"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["goodput"] == 0.5 and s["request_throughput"] == 1.0
    assert s["output_throughput"] == 5.0
    assert s["tpot"]["mean"] == pytest.approx(0.1)
    assert s["ttft"]["p50"] == pytest.approx(1.05)


@pytest.mark.slow
def test_client_against_a_spawned_server(tmp_path, capsys):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = cli_main(["bench", "serve", "--spawn", "--num-prompts", "3", "--output-len", "4",
                   "--request-rate", "20,inf", "--max-concurrency", "2", "--label", "tiny",
                   "--slo", "ttft=600,tpot=600", "--json", str(out), "--plot", str(plot),
                   "--max-model-len", "512", "--num-gpu-blocks", "96", "--max-num-seqs", "4",
                   "--server-log", str(tmp_path / "server.log")])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, math.inf]
    for r in runs:
        assert r["completed"] == r["sent"] == 3 and r["label"] == "tiny"
        assert r["output_throughput"] > 0 and r["goodput"] == r["request_throughput"]
        assert 0 < r["ttft"]["p50"] <= r["e2e"]["p50"]
        assert r["tpot"]["mean"] > 0 and r["itl"]["p99"] > 0
        assert r["preemptions"] is not None and r["preemptions"] >= 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "| tiny | inf | 3/3 |" in capsys.readouterr().out
    # merging saved runs into one picture, no server needed
    merged = tmp_path / "merged.png"
    assert cli_main(["bench", "serve", "--from-json", str(out), str(out), "--plot",
                     str(merged)]) == 0
    assert merged.exists()


@pytest.mark.slow
def test_embeddings_against_sentence_transformers(tmp_path, capsys):
    """On a tiny sentence-transformers directory whose words are token ids (w256 ... w511), so
    the workload's prompts come back from text as they were."""
    from tiny_models import save_sentence_transformer

    model = tmp_path / "model"
    save_sentence_transformer(str(model), "mean_tokens", True, vocab_size=512)
    out = tmp_path / "embed.json"
    rc = cli_main(["bench", "serve", "--spawn", "--endpoint", "embeddings", "--num-prompts", "4",
                   "--compare", "sentence-transformers", "--repeats", "1", "--model", str(model),
                   "--vocab-size", "512", "--embed-batch-size", "2", "--json", str(out),
                   "--max-model-len", "256", "--num-gpu-blocks", "96", "--max-num-seqs", "4"])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["conveyor", "sentence-transformers"]
    for r in runs:
        assert r["completed"] == r["sent"] == 4
        assert r["request_throughput"] > 0 and r["total_token_throughput"] > 0
        assert r["output_throughput"] == 0
    # both sides tokenize the same texts with the same tokenizer
    assert runs[0]["total_token_throughput"] * runs[0]["duration_s"] == pytest.approx(
        runs[1]["total_token_throughput"] * runs[1]["duration_s"])
    table = capsys.readouterr().out
    assert "| conveyor | inf | 4/4 |" in table and "| sentence-transformers | - | 4/4 |" in table
    with pytest.raises(SystemExit, match="unknown peer 'vllm' for --endpoint embeddings"):
        cli_main(["bench", "serve", "--spawn", "--endpoint", "embeddings", "--compare", "vllm"])


def test_a_server_that_exits_before_ready_says_why():
    """A replica's error inside Ray's log prefixes, under Ray Serve's wrapper errors, is the
    message; nothing listens on the port, so only the early exit can end the wait."""
    import socket
    import sys

    from conveyor.bench.serving import serving_process

    script = ("import sys\n"
              "print('\\x1b[36m(ServeController pid=7)\\x1b[0m RuntimeError: Traceback (most "
              "recent call last):')\n"
              "print('\\x1b[36m(ServeController pid=7)\\x1b[0m ValueError: max_model_len=6144 "
              "is more than policy prefill_first can run')\n"
              "print('RuntimeError: Deploying application conveyor failed')\n"
              "sys.exit(1)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError) as e, \
            serving_process([sys.executable, "-c", script], port, "conveyor serve"):
        pass
    assert str(e.value).startswith("conveyor serve exited with 1 before it was ready "
                                   "(ValueError: max_model_len=6144 is more than policy "
                                   "prefill_first can run): ")
