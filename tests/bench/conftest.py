"""Fixtures the peer tests share."""

from __future__ import annotations

import dataclasses
import stat
import sys

import pytest

from conveyor.bench.peer_env import STAMP


@pytest.fixture
def fake_peer_env(tmp_path, monkeypatch):
    """``make(module, files)``: the peer ``module``'s environment (``module.ENV``, its
    ``skip_reason`` cache cleared) made ready under ``tmp_path``, its "Python" this interpreter
    behind a wrapper that puts a fake of the peer's package on its path: ``files``, each a path
    under that site folder and its text. The bench strips PYTHONPATH from a driver's
    environment and the wrapper sets the fake's; Conveyor's own (set here) must not get
    through."""
    touched = []

    def make(module, files: dict[str, str]):
        site = tmp_path / "fake-site"
        for name, text in files.items():
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            (site / name).write_text(text)
        env = dataclasses.replace(module.ENV, root=tmp_path / "envs")
        env.python.parent.mkdir(parents=True)
        env.python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
        env.python.chmod(env.python.stat().st_mode | stat.S_IEXEC)
        (env.path / STAMP).write_text("")
        monkeypatch.setenv("PYTHONPATH", "/conveyor/should/not/leak")
        monkeypatch.setattr(module, "ENV", env)
        module.skip_reason.cache_clear()
        touched.append(module)
        return env

    yield make
    for module in touched:
        module.skip_reason.cache_clear()
