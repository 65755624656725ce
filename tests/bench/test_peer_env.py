"""Peer environments (``peer_env.PeerEnv``), for every peer that has one: a build that cannot
happen or fails is the row's reason, and the build steps get the variables they need."""

import argparse
import dataclasses
import os
import stat
import sys

import pytest

from conveyor.bench import peers_llamacpp, peers_vllm, throughput
from conveyor.bench.peers import PeerJob, skip_reason


@pytest.mark.parametrize(("module", "system", "label"), [
    (peers_vllm, "vllm", "vLLM"), (peers_llamacpp, "llamacpp", "llama.cpp")])
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


@pytest.mark.parametrize(("module", "system"), [(peers_vllm, "vllm"), (peers_llamacpp, "llamacpp")])
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


def test_both_llama_cpp_peers_share_one_environment(monkeypatch):
    monkeypatch.setattr(peers_llamacpp, "skip_reason",
                        lambda: "skipped (llama.cpp environment: x)")
    assert skip_reason("llamacpp") == skip_reason("llamacpp-lookup") == \
        "skipped (llama.cpp environment: x)"


def test_a_missing_compiler_is_said_before_anything_is_built(tmp_path):
    env = dataclasses.replace(peers_llamacpp.ENV, root=tmp_path / "envs", build_tools=[
        ("cc", "a C compiler"), ("conveyor-no-such-c++", "a C++ compiler (Debian: apt-get "
                                                          "install g++)")])
    assert env.skip_reason() == ("skipped (llama.cpp environment: building it needs a C++ "
                                 "compiler (Debian: apt-get install g++): "
                                 "`conveyor-no-such-c++` is not on PATH)")
    assert not env.root.exists()


def test_the_build_gets_cmake_args_unless_the_caller_set_them(tmp_path, monkeypatch):
    """The build steps see CMAKE_ARGS (llama.cpp built for this CPU); one in the bench's own
    environment wins. The environment's "Python" here records what each step saw."""
    seen = tmp_path / "cmake-args.txt"
    env = dataclasses.replace(peers_llamacpp.ENV, root=tmp_path / "envs", build_tools=[])
    env.python.parent.mkdir(parents=True)
    env.python.write_text(f"#!/bin/sh\necho \"$1 $CMAKE_ARGS\" >> {seen}\n")
    env.python.chmod(env.python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert env.ensure() is None and env.ready()
    assert seen.read_text().splitlines() == ["-m -DGGML_NATIVE=ON", "-c -DGGML_NATIVE=ON"]
    assert "$ CMAKE_ARGS=-DGGML_NATIVE=ON " in env.log_path.read_text()
    (env.path / ".conveyor-ready").unlink()
    seen.unlink()
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_BLAS=ON")
    assert env.ensure() is None
    assert seen.read_text().splitlines()[0] == "-m -DGGML_BLAS=ON"
