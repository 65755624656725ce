"""An isolated virtual environment for a peer whose requirements clash with Conveyor's.

A peer such as vLLM pins its own torch and transformers, so it lives in its own environment
under ``.venv-peers/`` (``CONVEYOR_PEER_ENVS`` moves it), built on first use with ``python -m
venv`` and pip, the packages installed in the order given (torch first: pip then finds the
wheel already there), then any it must not keep removed. A stamp file marks a finished, import-checked build; a build that fails
leaves no stamp, and its reason is what the bench prints in the peer's row.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

STAMP = ".conveyor-ready"


def peer_envs_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_PEER_ENVS", ".venv-peers"))


@dataclass
class PeerEnv:
    name: str  # the folder under peer_envs_dir()
    installs: list[list[str]]  # pip install argument lists, run in order
    check_import: str  # a module that must import once built
    uninstalls: list[str] = field(default_factory=list)  # packages removed after installing
    root: Path = field(default_factory=peer_envs_dir)

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

    def ensure(self) -> str | None:
        """Build the environment unless it is ready; None when ready, else why it is not."""
        if self.ready():
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        steps = [[sys.executable, "-m", "venv", str(self.path)]] if not self.python.exists() else []
        steps += [[str(self.python), "-m", "pip", "install", *args] for args in self.installs]
        if self.uninstalls:
            steps.append([str(self.python), "-m", "pip", "uninstall", "-y", *self.uninstalls])
        steps.append([str(self.python), "-c", f"import {self.check_import}"])
        print(f"[bench] building the {self.name} peer's environment in {self.path} "
              f"(once; several minutes; log {self.log_path}) ...", file=sys.stderr, flush=True)
        with open(self.log_path, "a") as log:
            for cmd in steps:
                shown = " ".join(["python", *cmd[1:]] if cmd[0] == str(self.python) else cmd)
                print(f"[bench]   {shown}", file=sys.stderr, flush=True)
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                try:
                    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.PIPE, text=True,
                                          check=False)
                except OSError as e:
                    return f"{cmd[0]}: {e}"
                log.write(proc.stderr)
                if proc.returncode != 0:
                    return f"`{shown}` failed: {last_error_line(proc.stderr)}"
        (self.path / STAMP).write_text("\n".join(" ".join(a) for a in self.installs) + "\n")
        return None


def last_error_line(stderr: str) -> str:
    """The line of a failed command's stderr that says why: pip's ``ERROR:``, a Python
    exception, else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in lines:
        if line.startswith("ERROR:"):
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"
