"""An isolated virtual environment for a peer, and running the peer's driver script in it.

A peer such as vLLM pins its own torch and transformers, and llama.cpp (llama-cpp-python)
compiles itself when installed, so each lives in its own environment under ``.venv-peers/``
(``CONVEYOR_PEER_ENVS`` moves it), built on first use with ``python -m venv`` and pip, the
packages installed in the order given (torch first: pip then finds the wheel already there),
with the environment variables the build needs, then any it must not keep removed. A stamp file
marks a finished, import-checked build; a build that fails leaves no stamp, and its reason is
what the bench prints in the peer's row.

The peer never runs inside Conveyor's process: the bench writes a request JSON, runs the peer's
driver (a standalone script shipped beside the bench, importing only the standard library, the
peer and ``peer_driver.py``) with the environment's Python, and reads back its result JSON
(``PeerEnv.run_driver``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAMP = ".conveyor-ready"
DRIVER_TIMEOUT_S = 3600.0


def peer_envs_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_PEER_ENVS", ".venv-peers"))


@dataclass
class PeerEnv:
    name: str  # the folder under peer_envs_dir()
    installs: list[list[str]]  # pip install argument lists, run in order
    check_import: str  # a module that must import once built
    uninstalls: list[str] = field(default_factory=list)  # packages removed after installing
    root: Path = field(default_factory=peer_envs_dir)
    label: str = ""  # how rows and errors name the peer ("vLLM"); default: name
    # environment variables of the build steps (a build's CMAKE_ARGS); one already set in this
    # process's environment wins
    build_env: dict[str, str] = field(default_factory=dict)
    # (command, what it is and where to get it): commands the build runs, checked up front
    build_tools: list[tuple[str, str]] = field(default_factory=list)
    # lines of a failed driver's output that wrap the root cause rather than say it
    wrapper_errors: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return self.root / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}-install.log"

    def ready(self) -> bool:
        return (self.path / STAMP).exists() and self.python.exists()

    def missing_tool(self) -> str | None:
        """Why the build cannot start here (a compiler it needs is not on PATH), else None."""
        for command, what in self.build_tools:
            if shutil.which(command) is None:
                return f"building it needs {what}: `{command}` is not on PATH"
        return None

    def ensure(self) -> str | None:
        """Build the environment unless it is ready; None when ready, else why it is not."""
        if self.ready():
            return None
        missing = self.missing_tool()
        if missing:
            return missing
        self.root.mkdir(parents=True, exist_ok=True)
        steps = [[sys.executable, "-m", "venv", str(self.path)]] if not self.python.exists() else []
        steps += [[str(self.python), "-m", "pip", "install", *args] for args in self.installs]
        if self.uninstalls:
            steps.append([str(self.python), "-m", "pip", "uninstall", "-y", *self.uninstalls])
        steps.append([str(self.python), "-c", f"import {self.check_import}"])
        print(f"[bench] building the {self.name} peer's environment in {self.path} "
              f"(once; several minutes; log {self.log_path}) ...", file=sys.stderr, flush=True)
        env = {**self.build_env, **os.environ}  # a variable the caller set wins
        shown_env = " ".join(f"{k}={shlex.quote(env[k])}" for k in self.build_env)
        with open(self.log_path, "a") as log:
            for cmd in steps:
                shown = " ".join(["python", *cmd[1:]] if cmd[0] == str(self.python) else cmd)
                prefix = f"{shown_env} " if shown_env and "pip" in cmd[1:3] else ""
                print(f"[bench]   {prefix}{shown}", file=sys.stderr, flush=True)
                log.write(f"$ {prefix}{' '.join(cmd)}\n")
                log.flush()
                try:
                    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.PIPE, text=True,
                                          env=env, check=False)
                except OSError as e:
                    return f"{cmd[0]}: {e}"
                log.write(proc.stderr)
                if proc.returncode != 0:
                    return (f"`{shown}` failed: {last_error_line(proc.stderr)} "
                            f"(log {self.log_path})")
        (self.path / STAMP).write_text("\n".join(" ".join(a) for a in self.installs) + "\n")
        return None

    def skip_reason(self) -> str | None:
        """None when the environment is ready (built now if need be), else the row's text."""
        reason = self.ensure()
        return None if reason is None else f"skipped ({self.label or self.name} environment: " \
                                           f"{reason})"

    def process_env(self) -> dict[str, str]:
        """The environment a driver runs in: this one's Python, no trace of Conveyor's venv."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["VIRTUAL_ENV"] = str(self.path)
        return env

    def run_driver(self, driver: Path, request: dict[str, Any], env: dict[str, str] | None = None,
                   timeout: float = DRIVER_TIMEOUT_S) -> dict[str, Any]:
        """``python DRIVER REQUEST.json RESULT.json`` with this environment's Python (in
        ``env``, default ``process_env()``); the result JSON, or a RuntimeError with the root
        cause from the driver's output, which goes to this process's stderr (a bench worker's
        log keeps it)."""
        with tempfile.TemporaryDirectory(prefix=f"conveyor-{self.name}-") as tmp:
            request_path, result_path, log_path = (Path(tmp) / f for f in (
                "request.json", "result.json", "driver.log"))
            request_path.write_text(json.dumps(request))
            with open(log_path, "w") as log:
                proc = subprocess.run([str(self.python), str(driver), str(request_path),
                                       str(result_path)], env=env or self.process_env(),
                                      stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                      check=False)
            output = log_path.read_text(errors="replace")
            sys.stderr.write(output[-20000:])
            if proc.returncode != 0 or not result_path.exists():
                raise RuntimeError(f"{self.label or self.name} driver exit {proc.returncode}: "
                                   f"{self.driver_error(output)}")
            return json.loads(result_path.read_text())

    def driver_error(self, output: str) -> str:
        """The root cause in a failed driver's output: the first exception line of the last
        traceback that is not one of the peer's ``wrapper_errors``."""
        return root_cause(output, self.wrapper_errors)


# Ray prefixes a worker's lines with its colored name, e.g. "\x1b[36m(ServeController pid=7)\x1b[0m "
_WORKER_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\([^()]*pid=\d+[^()]*\)(?:\x1b\[[0-9;]*m)*\s*")


def root_cause(output: str, wrapper_errors: tuple[str, ...] = ()) -> str:
    """The first exception line of the last traceback in a failed program's output (a Ray
    worker's lines too) that does not contain one of ``wrapper_errors``; else its last line."""
    lines = [_WORKER_PREFIX.sub("", line.strip()) for line in output.splitlines()]
    causes = [line for line in lines if _is_exception_line(line)
              and not any(w in line for w in wrapper_errors)]
    return causes[-1][:300] if causes else last_error_line(output)


def _is_exception_line(line: str) -> bool:
    head = line.split(":", 1)[0]
    name = head.rsplit(".", 1)[-1]
    return (":" in line and " " not in head and name[:1].isupper()
            and name.endswith(("Error", "Exception", "Interrupt")))


def last_error_line(stderr: str) -> str:
    """The line of a failed command's stderr that says why: pip's ``ERROR:``, a Python
    exception, else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in lines:
        if line.startswith("ERROR:"):
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"
