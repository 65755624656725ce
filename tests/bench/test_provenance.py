"""The provenance block of a result file: right for a fresh run, the peers that ran, and the
git state of the tree that ran."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor
from conveyor.bench.provenance import CPU_FLAGS, git_state
from conveyor.bench.throughput import ran_peer_versions
from conveyor.entrypoints.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _cpuinfo() -> tuple[str | None, set[str]]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = [line.partition(":") for line in text.splitlines()]
    models = [v.strip() for k, _, v in lines if k.strip() == "model name"]
    flags = [set(v.split()) for k, _, v in lines if k.strip() == "flags"]
    return (models[0] if models else None), (flags[0] if flags else set())


def test_a_fresh_scheduler_run_records_where_it_came_from(tmp_path, monkeypatch):
    out = tmp_path / "sched.json"
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    argv = ["bench", "scheduler", "--num-requests", "8", "--runs", "1", "--num-gpu-blocks",
            "200", "--policies", "chunked", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["conveyor", *argv])  # as the console script runs it
    assert cli_main(argv) == 0
    after = datetime.datetime.now(datetime.timezone.utc)
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("conveyor ")
    assert payload["results"][0]["policy"] == "chunked"
    p = payload["provenance"]
    assert before <= datetime.datetime.fromisoformat(p["date"]) <= after
    assert p["conveyor"] == conveyor.__version__
    assert p["python"] == platform.python_version()
    assert p["torch"] == importlib.metadata.version("torch")
    model, flags = _cpuinfo()
    assert p["cpu"] == {"model": model or platform.processor() or None,
                        "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count()}
    assert p["peers"] == {}
    checkout = Path(conveyor.__file__).resolve().parent == ROOT / "src" / "conveyor"
    if shutil.which("git") and checkout and (ROOT / ".git").exists():
        assert p["commit"] == _git(ROOT, "rev-parse", "HEAD")
        assert p["dirty"] is bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no",
                                       "--", "src"))
    else:
        assert p["commit"] is None and p["dirty"] is None


@needs_git
def test_git_state_names_the_commit_and_local_changes_to_src_only(tmp_path):
    package = tmp_path / "src" / "conveyor"
    package.mkdir(parents=True)
    (package / "engine.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("readme\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_state(package) == (head, False)
    (tmp_path / "README.md").write_text("changed\n")
    (package / "new_module.py").write_text("untracked\n")
    assert git_state(package) == (head, False)
    (package / "engine.py").write_text("x = 2\n")
    assert git_state(package) == (head, True)
    # a copy installed elsewhere inside the checkout (a venv's site-packages) has no commit
    installed = tmp_path / ".venv" / "site-packages" / "conveyor"
    installed.mkdir(parents=True)
    assert git_state(installed) == (None, None)


def test_outside_git_there_is_no_commit(tmp_path):
    assert git_state(tmp_path) == (None, None)


def test_peer_versions_name_the_peers_that_ran():
    results = json.loads((ROOT / "benchmarks/results/zen4/throughput_W1.json").read_text())[
        "results"]
    llamacpp = next(r for r in results if r["system"] == "llamacpp")
    llamacpp["repeats"], llamacpp["skipped"] = [], "skipped (not installed)"
    assert ran_peer_versions(results) == {
        "transformers": importlib.metadata.version("transformers"), "vllm": "0.32.0"}
