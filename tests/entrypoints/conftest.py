"""Fixtures for the HTTP server tests: ``conveyor serve`` as a real subprocess on 127.0.0.1 and a
free port, ready once /health answers 200, stopped with SIGTERM at teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Small and fixed, so that the server and the in-process LLM run the very same engine.
ENGINE_KWARGS = {"max_model_len": 512, "num_gpu_blocks": 256, "max_num_seqs": 64,
                 "block_size": 16, "seed": 0}
BUSY_MAX_QUEUED = 6


def engine_flags(**overrides: object) -> list[str]:
    flags = []
    for name, value in {**ENGINE_KWARGS, **overrides}.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, https_cert: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args = args
        self.startup_responses: list[httpx.Response] = []  # /health while waiting for ready
        self.port = free_port()
        scheme = "http" if https_cert is None else "https"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = (True if https_cert is None else
                                              ssl.create_default_context(cafile=str(https_cert)))
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        # One torch thread: on a shared, oversubscribed CPU two spinning OpenMP threads per
        # process make every step many times slower; the in-process LLM uses one too.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TQDM_DISABLE": "1",
                                          "OMP_NUM_THREADS": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                resp = httpx.get(self.base_url + "/health", timeout=2, verify=self.verify)
                self.startup_responses.append(resp)
                if resp.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """``{'name{label=value,...}': value}`` from /metrics (labels sorted, model_name left out)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10, verify=self.verify,
                         headers=headers).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def start_fleet(tmp_path_factory: pytest.TempPathFactory, flags: list[str]) -> ServerProcess:
    """A Ray Serve fleet (``flags``: its fleet flags) on ENGINE_KWARGS, ready when returned."""
    # Ray's router then asks each replica its queue length before every choice instead of
    # using a cached one (as after 10 s idle): the slow path where choices could be swapped.
    s = ServerProcess(flags + engine_flags(), tmp_path_factory.mktemp("fleet") / "log",
                      env={"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "0"})
    s.wait_ready(timeout=400)
    return s


def _busy_server_process(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    # saturated at 2 running sequences (the chunked policy caps running, not just a step),
    # priority queue, bounded waiting queue
    return ServerProcess(engine_flags(max_num_seqs=2, queue="priority", policy="chunked")
                         + ["--max-queued-requests", str(BUSY_MAX_QUEUED),
                            "--shutdown-timeout", "60"],
                         tmp_path_factory.mktemp("server") / "log")


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Both test servers, started together (loading the model is the slow part)."""
    started = {
        # fcfs, room for 64 concurrent requests
        "default": ServerProcess(engine_flags(), tmp_path_factory.mktemp("server") / "log"),
        "busy": _busy_server_process(tmp_path_factory),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(flags, https_cert=None, env=None)``: one more server on ENGINE_KWARGS, ready
    when returned, stopped after the test module."""
    started: list[ServerProcess] = []

    def start(flags: list[str], https_cert: Path | None = None,
              env: dict[str, str] | None = None) -> ServerProcess:
        s = ServerProcess(engine_flags() + flags, tmp_path_factory.mktemp("server") / "log",
                          https_cert, env)
        started.append(s)
        s.wait_ready()
        return s

    try:
        yield start
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="session")
def server(servers) -> ServerProcess:
    return servers["default"]


@pytest.fixture
def busy_server(servers, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The busy server, started again when a test (a SIGTERM one) has stopped it."""
    if servers["busy"].proc.poll() is not None:
        servers["busy"] = _busy_server_process(tmp_path_factory)
        servers["busy"].wait_ready()
    return servers["busy"]


@pytest.fixture(scope="session")
def llm():
    """The offline API on the same engine settings, for output equality."""
    from conveyor.engine.llm import LLM

    return LLM(**ENGINE_KWARGS)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run the in-process LLM as the servers run (OMP_NUM_THREADS=1), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def one_thread():
    return _one_torch_thread
