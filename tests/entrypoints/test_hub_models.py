"""Models by Hugging Face repository name against a local server in the Hub's API shape
(``tests/hub_fixture.py``; never the real Hub): which files a reference names; ``conveyor pull``
resuming a download whose connection was cut, refetching a cached file whose checksum no longer
matches and fetching nothing for an intact one; ``--model REPO:QUANT`` offline afterwards giving
the same text as the model file itself; ``conveyor list`` and ``rm``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.hub import ModelRef, choose_files, parse_ref
from conveyor.model.loader import default_model_path
from hub_fixture import FakeHub

REPO = "conveyor-test/smol-gguf"
GGUF = "smollm2-135m-instruct.Q4_1.gguf"
CUT_AT = 30_000_000  # past huggingface_hub's first 10 MiB chunks: those are kept


@pytest.mark.parametrize(("files", "selector", "chosen"), [
    (["a.Q4_K_M.gguf", "a.Q8_0.gguf", "README.md"], None, ["a.Q4_K_M.gguf"]),
    (["a.Q4_K_M.gguf", "a.Q8_0.gguf"], "Q8_0", ["a.Q8_0.gguf"]),
    (["a.Q4_K_M.gguf", "a.Q8_0.gguf"], "q8_0", ["a.Q8_0.gguf"]),
    (["a.Q4_K_M.gguf", "a.Q8_0.gguf"], "a.Q4_K_M.gguf", ["a.Q4_K_M.gguf"]),
    (["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf", "m-Q8_0.gguf"], "Q4_K_M",
     ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"]),
    (["config.json", "model.safetensors", "tokenizer.json", "README.md", "x.Q4_0.gguf"], None,
     ["config.json", "model.safetensors", "tokenizer.json"]),
    (["b.F16.gguf", "b.IQ2_XS.gguf"], None, ["b.F16.gguf"]),
])
def test_which_files_a_reference_names(files, selector, chosen) -> None:
    assert choose_files(files, selector) == chosen


def test_references_and_what_is_not_one(tmp_path) -> None:
    assert parse_ref("org/name:Q4_K_M") == ModelRef("org/name", "Q4_K_M")
    assert parse_ref("org/name") == ModelRef("org/name")
    assert parse_ref("gemma-3-270m") is None and parse_ref("/abs/path.gguf") is None
    (tmp_path / "dir").mkdir()
    assert parse_ref(str(tmp_path / "dir")) is None
    with pytest.raises(ValueError, match=r"no file or GGUF quantization 'Q2_K'.*tags: Q8_0"):
        choose_files(["a.Q8_0.gguf"], "Q2_K", "org/a")


@pytest.fixture(scope="module")
def hub():
    fake = FakeHub({REPO: {GGUF: Path(default_model_path()),
                           "smollm2-135m-instruct.Q8_0.gguf": b"GGUF not really",
                           "README.md": b"# a model for the pull tests\n"}})
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def env(hub, tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("hf")
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache / "hub"),
            "HF_HOME": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def conveyor(env: dict[str, str], *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor.entrypoints.cli", *args],
                          env={**env, **extra_env}, capture_output=True, text=True,
                          timeout=600)


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_pull_resumes_checks_and_refetches(hub, env) -> None:
    want = _sha256(default_model_path())
    hub.cut_next[GGUF] = CUT_AT
    done = conveyor(env, "pull", f"{REPO}:Q4_1")
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip().splitlines()[-1]
    assert path.endswith(GGUF) and _sha256(path) == want
    first, resumed = hub.downloads(GGUF)  # the second asks for the rest only
    assert first is None and resumed.startswith("bytes=") and resumed.endswith("-")
    assert 0 < int(resumed[6:-1]) <= CUT_AT
    again = conveyor(env, "pull", f"{REPO}:Q4_1")
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == path
    assert len(hub.downloads(GGUF)) == 2  # intact: nothing fetched
    blob = Path(path).resolve()
    with open(blob, "r+b") as f:  # corrupt the cached copy
        f.seek(5_000_000)
        f.write(b"\0" * 64)
    assert _sha256(path) != want
    fixed = conveyor(env, "pull", f"{REPO}:Q4_1")
    assert fixed.returncode == 0, fixed.stderr
    assert _sha256(path) == want and len(hub.downloads(GGUF)) == 3  # fetched again, whole
    assert hub.downloads(GGUF)[-1] is None


@pytest.mark.slow
def test_model_repo_works_offline_after_a_pull(hub, env) -> None:
    assert conveyor(env, "pull", f"{REPO}:Q4_1").returncode == 0
    asked = len(hub.requests)
    args = ["generate", "The capital of France is", "--max-tokens", "6", "--temperature", "0",
            "--json", "--max-model-len", "256"]
    offline = conveyor(env, *args, "--model", f"{REPO}:Q4_1", HF_HUB_OFFLINE="1",
                       HF_ENDPOINT="http://127.0.0.1:9")  # nowhere: it must not be needed
    assert offline.returncode == 0, offline.stderr
    assert len(hub.requests) == asked
    direct = conveyor(env, *args, "--model", default_model_path())
    assert direct.returncode == 0, direct.stderr
    text = [json.loads(r.stdout)[0]["outputs"][0]["text"] for r in (offline, direct)]
    assert text[0] == text[1] and text[0]
    missing = conveyor(env, *args, "--model", "conveyor-test/never-pulled", HF_HUB_OFFLINE="1")
    assert missing.returncode != 0 and "not in the Hugging Face cache" in missing.stderr


@pytest.mark.slow
def test_list_rm_and_errors(hub, env) -> None:
    assert conveyor(env, "pull", REPO).returncode == 0  # the default pick: a Q4 file
    listed = conveyor(env, "list")
    assert listed.returncode == 0 and REPO in listed.stdout and GGUF in listed.stdout
    bad = conveyor(env, "pull", f"{REPO}:Q2_K")
    assert bad.returncode != 0 and "tags: Q4_1" not in bad.stderr and "Q2_K" in bad.stderr
    unknown = conveyor(env, "pull", "conveyor-test/nothing-here")
    assert unknown.returncode != 0 and "cannot pull" in unknown.stderr
    removed = conveyor(env, "rm", REPO)
    assert removed.returncode == 0 and GGUF in removed.stdout
    assert REPO not in conveyor(env, "list").stdout
    again = conveyor(env, "rm", REPO)
    assert again.returncode != 0 and "not in the Hugging Face cache" in again.stderr
