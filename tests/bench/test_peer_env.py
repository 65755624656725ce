"""Peer environments (``peer_env.PeerEnv``), for every peer that has one: a build that fails is
the row's reason, and the other rows run."""

import argparse
import dataclasses
import os
import sys

import pytest

from conveyor.bench import peers_vllm, throughput
from conveyor.bench.peers import PeerJob, skip_reason


@pytest.mark.parametrize(("module", "system", "label"), [(peers_vllm, "vllm", "vLLM")])
def test_failed_environment_build_is_the_rows_reason(tmp_path, monkeypatch, module, system,
                                                     label):
    """The environment's Python exists, its pip install cannot succeed."""
    env = dataclasses.replace(module.ENV, root=tmp_path / "envs",
                              installs=[["--no-index", "conveyor-no-such-package==0.0"]])
    env.python.parent.mkdir(parents=True)
    os.symlink(sys.executable, env.python)
    monkeypatch.setattr(module, "ENV", env)
    module.skip_reason.cache_clear()
    try:
        reason = skip_reason(system)
        assert reason.startswith(f"skipped ({label} environment: `python -m pip install "
                                 "--no-index conveyor-no-such-package==0.0` failed: ERROR: ")
        assert reason.endswith(f" (log {env.log_path}))")
        assert not env.ready()
        assert "conveyor-no-such-package" in env.log_path.read_text()
        # the worker side returns the same skipped row rather than failing
        row = module.run(PeerJob(system, "m.gguf", "W1", 0, 2, 1, "bfloat16", 16))
        assert row.skipped == reason and not row.repeats
    finally:
        module.skip_reason.cache_clear()


@pytest.mark.parametrize(("module", "system"), [(peers_vllm, "vllm")])
def test_a_skipped_peer_keeps_the_other_rows(monkeypatch, module, system):
    monkeypatch.setattr(module, "skip_reason", lambda: "skipped (its environment: no network)")
    ran = []

    def fake_worker(job, name, config):
        ran.append(name)
        return throughput.SystemResult(name, config, skipped="failed (test)")

    monkeypatch.setattr(throughput, "run_worker", fake_worker)
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--workload", "W1", "--compare",
                              f"transformers,{system}", "--no-roofline", "--repeats", "1"])
    rows = {r["system"]: r for r in throughput.run_all(args)["results"]}
    assert rows[system]["skipped"] == "skipped (its environment: no network)"
    assert ran == ["conveyor", "transformers"]
