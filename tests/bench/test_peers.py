"""Peers: a missing one is reported as skipped, never dropped; unknown names are refused."""

import importlib.util

import pytest

from conveyor.bench import peers, throughput
from conveyor.bench.peers import PEERS, skip_reason


def test_uninstalled_peer_is_skipped(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert skip_reason("llamacpp") == "skipped (not installed)"


def test_unknown_peer_is_a_clear_error():
    with pytest.raises(ValueError, match="--compare"):
        skip_reason("vllm")


def test_transformers_peer_available_here():
    assert skip_reason("transformers") is None
    assert set(PEERS) == {"transformers", "transformers-cb", "llamacpp"}


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
