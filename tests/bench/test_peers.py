"""Peers: a missing one is reported as skipped, never dropped; unknown names are refused."""

import dataclasses
import importlib.util

import pytest

from conveyor.bench import peers, throughput
from conveyor.bench.peers import PEERS, skip_reason


def test_uninstalled_peer_is_skipped(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert skip_reason("transformers") == "skipped (not installed)"


def test_unknown_peer_is_a_clear_error():
    with pytest.raises(ValueError, match="--compare"):
        skip_reason("tgi")


def test_transformers_peer_available_here():
    assert skip_reason("transformers") is None
    assert set(PEERS) == {"transformers", "transformers-cb", "llamacpp", "llamacpp-lookup",
                          "vllm"}


def test_skipped_peer_appears_in_the_run(monkeypatch, tmp_path):
    """run_all keeps a row for a peer that cannot run (Conveyor's worker stubbed by a failure)."""
    monkeypatch.setattr(throughput, "skip_reason",
                        lambda name: "skipped (not installed)" if name == "llamacpp" else None)
    calls = []

    def fake_worker(job, system, config):
        calls.append(system)
        return throughput.SystemResult(system, config, skipped="failed (test)")

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    parser = throughput_parser()
    args = parser.parse_args(["throughput", "--workload", "S1", "--compare", "llamacpp",
                              "--no-roofline", "--repeats", "1"])
    payload = throughput.run_all(args)
    rows = {r["system"]: r for r in payload["results"]}
    assert rows["llamacpp"]["skipped"] == "skipped (not installed)"
    assert calls == ["conveyor"]


def throughput_parser():
    import argparse

    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    return parser


def test_also_with_runs_conveyor_again_with_changed_flags(monkeypatch):
    jobs = []

    def fake_worker(job, system, config):
        jobs.append(job)
        return throughput.SystemResult(system, "float32", skipped="failed (test)")

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    args = throughput_parser().parse_args([
        "throughput", "--workload", "S1", "--no-roofline", "--max-num-seqs", "8",
        "--also-with", "kv_cache_dtype=bfloat16", "--also-with", "enable-prefix-caching=false"])
    payload = throughput.run_all(args)
    engine = [j["engine_args"] for j in jobs]
    assert [(e["kv_cache_dtype"], e["enable_prefix_caching"], e["max_num_seqs"]) for e in engine] \
        == [("auto", True, 8), ("bfloat16", True, 8), ("auto", False, 8)]
    configs = [r["config"] for r in payload["results"]]
    assert configs[1:] == ["float32 (with kv_cache_dtype=bfloat16)",
                           "float32 (with enable-prefix-caching=false)"]


def test_interleave_runs_the_rows_repeats_in_turns(monkeypatch):
    """--interleave: one process per repeat, row 1's first repeat, row 2's first, row 1's
    second, ...; each row's table entry holds all its repeats, each on its own workload seed."""
    jobs = []

    def fake_worker(job, system, config):
        jobs.append(job)
        wall = 2.0 if job["engine_args"]["kv_cache_dtype"] == "auto" else 3.0
        return throughput.SystemResult(
            system, "float32", [throughput.Measurement(wall, 100, 10 * (job["first_repeat"] + 1))],
            extra={"tensor_parallel": {"steps": 4, "step_ms": 1e3 * wall / 4}})

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    args = throughput_parser().parse_args([
        "throughput", "--workload", "S1", "--no-roofline", "--repeats", "3", "--interleave",
        "--also-with", "kv_cache_dtype=bfloat16"])
    payload = throughput.run_all(args)
    assert [(j["engine_args"]["kv_cache_dtype"], j["first_repeat"], j["repeats"]) for j in jobs] \
        == [("auto", 0, 1), ("bfloat16", 0, 1), ("auto", 1, 1), ("bfloat16", 1, 1),
            ("auto", 2, 1), ("bfloat16", 2, 1)]
    rows = payload["results"]
    assert [[m["output_tokens"] for m in r["repeats"]] for r in rows] == [[10, 20, 30]] * 2
    assert rows[0]["extra"]["tensor_parallel"] == {"steps": 12, "step_ms": 500.0}
    assert rows[1]["config"] == "float32 (with kv_cache_dtype=bfloat16)"


@pytest.mark.parametrize(("changes", "message"), [
    ("kv_cache_dtype=int8", "invalid choice: 'int8'"),
    ("max_num_seqs=many", "invalid int value: 'many'"),
    ("compare=vllm", "'compare=vllm' is not NAME=VALUE with NAME an engine flag"),
    ("kv_cache_dtype", "is not NAME=VALUE"),
    ("enable_prefix_caching=maybe", "enable_prefix_caching is true or false"),
])
def test_also_with_refuses_bad_changes(changes, message):
    from conveyor.engine.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        throughput.engine_variant(EngineArgs(), changes)


def test_speculative_runs_a_row_per_method_and_llama_cpp_prompt_lookup(monkeypatch):
    jobs = []

    def fake_worker(job, system, config):
        jobs.append((system, job))
        return throughput.SystemResult(system, config, skipped="failed (test)")

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    monkeypatch.setattr(throughput, "skip_reason", lambda name: None)
    args = throughput_parser().parse_args([
        "throughput", "--workload", "C1", "--compare", "llamacpp", "--speculative", "ngram,off",
        "--num-speculative-tokens", "6", "--no-roofline", "--repeats", "1"])
    payload = throughput.run_all(args)
    assert [s for s, _ in jobs] == ["conveyor", "conveyor", "llamacpp", "llamacpp-lookup"]
    assert [j["engine_args"]["speculative_method"] for _, j in jobs[:2]] == ["ngram", None]
    assert jobs[3][1]["peer"]["setting"] == 6  # llama.cpp proposes as many tokens
    configs = [r["config"] for r in payload["results"]]
    assert configs[0].endswith(" (speculative ngram, k=6)")
    assert configs[1].endswith(" (speculative off)")


def test_acceptance_line():
    from conveyor.bench.speculative import acceptance_line
    from conveyor.core.stats import SchedulerStats

    assert acceptance_line(SchedulerStats()) is None
    line = acceptance_line(SchedulerStats(spec_draft_tokens=400, spec_accepted_tokens=300,
                                          spec_verifications=100))
    assert line == ("speculative tokens accepted 300 of 400 (75.0%), 4.00 tokens per "
                    "verifying decode")


def test_bad_compare_or_also_with_exit_with_a_message():
    for argv in (["--compare", "tgi"], ["--also-with", "kv_cache_dtype=int8"],
                 ["--speculative", "medusa"]):
        args = throughput_parser().parse_args(["throughput", "--no-roofline", *argv])
        with pytest.raises(SystemExit, match="conveyor bench throughput: --"):
            throughput.main(args)


def test_lora_adds_a_conveyor_row_with_adapters(monkeypatch):
    jobs = []

    def fake_worker(job, system, config):
        jobs.append(job)
        return throughput.SystemResult(system, config, skipped="failed (test)")

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    args = throughput_parser().parse_args(["throughput", "--workload", "W1", "--no-roofline",
                                           "--lora", "8", "--lora-rank", "32"])
    throughput.run_all(args)
    assert [j["lora"] for j in jobs] == [None, {"count": 8, "rank": 32}]
    lora_args = jobs[1]["engine_args"]
    assert lora_args["enable_lora"] and lora_args["max_loras"] == 8
    assert lora_args["max_lora_rank"] == 32 and not jobs[0]["engine_args"]["enable_lora"]


@pytest.mark.slow
def test_a_lora_run_generates_every_token_under_random_adapters():
    from conveyor.engine.args import EngineArgs

    ea = EngineArgs(enable_lora=True, max_loras=3, num_gpu_blocks=128, max_model_len=512)
    result = throughput.run_conveyor({
        "system": "conveyor", "workload": "W1", "seed": 0, "num_requests": 4, "repeats": 1,
        "engine_args": dataclasses.asdict(ea), "lora": {"count": 3, "rank": 4}})
    assert "3 LoRA adapters of rank 4 (max_loras 3, max_cpu_loras 3: 3 slot installs" \
        in result.config
    assert result.repeats[0].output_tokens == 4 * 128
