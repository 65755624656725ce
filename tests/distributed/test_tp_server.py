"""`conveyor serve --tensor-parallel-size 2` as a real process: it serves, a killed worker
turns into 503 and a non-zero exit, SIGTERM stops every rank; no process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conveyor.distributed.group import free_port


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _workers(pid: int) -> list[int]:
    """The server's tensor-parallel worker processes (spawned by multiprocessing)."""
    out = []
    for kid in _children(pid):
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(kid)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


class _Server:
    def __init__(self, model: str, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--port", str(self.port),
             "--model", model, "--dtype", "float32", "--num-gpu-blocks", "64",
             "--block-size", "8", "--tensor-parallel-size", "2", "--threads-per-rank", "1"],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.proc.kill()
        raise AssertionError("server not ready:\n" + self.log_path.read_text())

    def complete(self) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=60, json={
            "prompt": "w5 w6 w7 w8", "max_tokens": 4, "temperature": 0})


@pytest.mark.slow
def test_killed_worker_gives_503_and_a_nonzero_exit(tiny_llama: str, tmp_path: Path) -> None:
    server = _Server(tiny_llama, tmp_path)
    try:
        assert server.complete().status_code == 200
        (worker,) = _workers(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert server.complete().status_code == 503
        assert server.proc.wait(timeout=60) != 0
        assert "conveyor-tp-rank1" in server.log_path.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


@pytest.mark.slow
def test_sigterm_stops_every_rank(tiny_llama: str, tmp_path: Path) -> None:
    server = _Server(tiny_llama, tmp_path)
    try:
        assert server.complete().status_code == 200
        workers = _workers(server.proc.pid)
        assert len(workers) == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
