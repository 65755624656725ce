"""The vLLM peer's plumbing, without vLLM: its environment, the driver protocol, the skip path.

The driver (``vllm_driver.py``, the file the bench ships) runs in a subprocess whose "peer
environment" is this interpreter behind a wrapper that puts a small fake ``vllm`` package on
its path: the fake generates ``max_tokens`` token ids per request and records what it was
given, so the test checks the exact requests and settings that crossed the process boundary.
"""

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.bench import peers_vllm, serving, throughput
from conveyor.bench.peers import WARMUP_SEED_OFFSET, PeerJob
from conveyor.bench.workloads import make_workload

FAKE_VLLM = '''
import json, os, time

__version__ = "0.0-fake"
SEEN = os.environ["FAKE_VLLM_LOG"]


def _log(kind, payload):
    with open(SEEN, "a") as f:
        f.write(json.dumps({"kind": kind, **payload}) + "\\n")


def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}


class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, request_id, token_ids, finished, num_cached_tokens=None):
        self.request_id, self.outputs, self.finished = request_id, [_Completion(token_ids)], finished
        self.num_cached_tokens = num_cached_tokens


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    def __init__(self, llm):
        self.llm, self.pending = llm, []

    def add_request(self, request_id, prompt, params):
        _log("request", {"prompt_token_ids": prompt["prompt_token_ids"],
                         "max_tokens": params.max_tokens, "single": True})
        self.pending.append([request_id, params.max_tokens, []])

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        time.sleep(0.001)
        request_id, max_tokens, ids = self.pending[0]
        ids.append(300 + len(ids))
        if len(ids) == max_tokens:
            self.pending.pop(0)
        return [_Output(request_id, list(ids), len(ids) == max_tokens)]


class LLM:
    def __init__(self, model, seed, dtype, max_num_seqs, enable_prefix_caching):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise ValueError(os.environ["FAKE_VLLM_FAIL"])
        _log("init", {"model": model, "dtype": dtype, "max_num_seqs": max_num_seqs,
                      "enable_prefix_caching": enable_prefix_caching, "env": {
                          k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")}})
        self.llm_engine = _Engine(self)
        self.llm_engine.vllm_config = _Namespace(
            scheduler_config=_Namespace(max_num_batched_tokens=2048),
            model_config=_Namespace(max_model_len=8192),
            cache_config=_Namespace(block_size=128))

    def generate(self, prompts, params, use_tqdm):
        for p, sp in zip(prompts, params):
            _log("request", {"prompt_token_ids": p["prompt_token_ids"],
                             "max_tokens": sp.max_tokens, "single": False})
        return [_Output(str(i), [300] * sp.max_tokens, True, 16 * i)
                for i, sp in enumerate(params)]
'''


@pytest.fixture
def fake_vllm_env(tmp_path, monkeypatch, fake_peer_env):
    """A ready peer environment whose Python is this one with the fake vllm on its path."""
    fake_peer_env(peers_vllm, {"vllm/__init__.py": FAKE_VLLM})
    model_dir = tmp_path / "model-bf16"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setattr(peers_vllm, "converted_model", lambda path: model_dir)
    return log, model_dir


def _seen(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_driver_runs_the_workloads_exact_requests(fake_vllm_env):
    log, model_dir = fake_vllm_env
    job = PeerJob("vllm", "model.gguf", "W1", 5, 3, 2, "bfloat16", 16, prefix_caching=False)
    result = peers_vllm.run(job)

    init, *requests = _seen(log)
    assert init["model"] == str(model_dir.resolve())
    assert (init["dtype"], init["max_num_seqs"], init["enable_prefix_caching"]) == \
        ("bfloat16", 16, False)
    assert init["env"] == {"VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": str(
        Path(log).parent / "fake-site")}
    warmup = make_workload("W1", 49152, 5 + WARMUP_SEED_OFFSET, 3).requests[:2]
    expected = [(r.prompt_token_ids, 4) for r in warmup]
    for k in range(2):
        expected += [(r.prompt_token_ids, r.max_tokens)
                     for r in make_workload("W1", 49152, 5 + k, 3).requests]
    assert [(r["prompt_token_ids"], r["max_tokens"]) for r in requests] == expected

    assert result.skipped is None
    assert result.config == "bfloat16, max_num_seqs 16, prefix caching off, vLLM 0.0-fake"
    assert [m.output_tokens for m in result.repeats] == [3 * 128, 3 * 128]
    assert [m.prompt_tokens for m in result.repeats] == [
        make_workload("W1", 49152, 5 + k, 3).num_prompt_tokens for k in range(2)]
    assert all(m.wall_s > 0 for m in result.repeats)
    assert result.load_s >= 0 and result.peak_rss_mb > 0
    assert result.extra["vllm_version"] == "0.0-fake"
    assert result.extra["settings"]["max_num_batched_tokens"] == 2048
    assert result.extra["settings"]["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert result.extra["cached_prompt_tokens"] == [16 * (0 + 1 + 2)] * 2


def test_single_stream_times_each_token(fake_vllm_env):
    log, _ = fake_vllm_env
    result = peers_vllm.run(PeerJob("vllm", "model.gguf", "S1", 0, None, 1, "bfloat16", 64))
    (m,) = result.repeats
    assert m.output_tokens == 256 and m.prompt_tokens == 128
    assert 0 < m.ttft_s < m.wall_s
    assert 0 < m.decode_tokens_per_s < 255 / 0.001  # the fake sleeps 1 ms a step
    assert all(r["single"] for r in _seen(log)[1:])


def test_driver_failure_names_the_root_cause(fake_vllm_env, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no CPU backend for this dtype")
    with pytest.raises(RuntimeError, match="vLLM driver exit 1: ValueError: no CPU backend"):
        peers_vllm.run(PeerJob("vllm", "model.gguf", "S1", 0, None, 1, "bfloat16", 64))


def test_root_cause_skips_vllms_generic_wrapper_error():
    output = textwrap.dedent("""\
        INFO 11-26 cpu_worker.py:80] binding threads
        Traceback (most recent call last):
        torch.OutOfMemoryError: could not allocate the KV cache
        Traceback (most recent call last):
        RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
        """)
    assert peers_vllm.driver_error(output) == \
        "torch.OutOfMemoryError: could not allocate the KV cache"


def test_vllm_job_follows_conveyors_batch_and_prefix_caching():
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--workload", "W2", "--compare", "vllm",
                              "--max-num-seqs", "32", "--no-enable-prefix-caching"])
    (job,) = throughput.peer_jobs(args, "m.gguf", "bfloat16")
    assert (job.system, job.setting, job.prefix_caching) == ("vllm", 32, False)


def test_server_command_runs_vllms_module_on_loopback(tmp_path):
    cmd = peers_vllm.server_command(tmp_path / "m-bf16", 8123, "bfloat16", 64, True)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["--max-num-seqs"] == "64" and flags["--dtype"] == "bfloat16"
    assert "--enable-prefix-caching" in cmd and "--max-model-len" not in cmd
    cmd = peers_vllm.server_command(tmp_path / "m", 8123, "float32", 16, False, 512)
    assert cmd[-3:] == ["--no-enable-prefix-caching", "--max-model-len", "512"]


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_compare_needs_spawn_and_a_known_peer():
    with pytest.raises(SystemExit, match="--compare needs --spawn"):
        serving.compare_peers(_serve_args(["--base-url", "http://127.0.0.1:1", "--compare",
                                           "vllm"]))
    with pytest.raises(SystemExit, match="unknown peer 'tgi'"):
        serving.compare_peers(_serve_args(["--spawn", "--compare", "tgi"]))


def test_serve_skipped_vllm_is_reported_after_conveyors_runs(monkeypatch, tmp_path):
    import contextlib

    @contextlib.contextmanager
    def fake_server(argv, log_path=None):
        yield "http://127.0.0.1:1"

    async def fake_sweep(base, args):
        return [{"label": args.label, "request_rate": 1.0, "completed": 1, "sent": 1,
                 "request_throughput": 1.0, "output_throughput": 8.0, "preemptions": 0,
                 **{k: {"mean": 0.1, "p50": 0.1, "p90": 0.1, "p99": 0.1}
                    for k in ("ttft", "tpot", "itl", "e2e")}}]

    monkeypatch.setattr(serving, "spawned_server", fake_server)
    monkeypatch.setattr(serving, "run_sweep", fake_sweep)
    monkeypatch.setattr(peers_vllm, "skip_reason", lambda: "skipped (vLLM environment: x)")
    out = tmp_path / "serve.json"
    args = _serve_args(["--spawn", "--compare", "vllm", "--json", str(out)])
    assert serving.main(args) == 0
    saved = json.loads(out.read_text())
    assert [r["label"] for r in saved["runs"]] == ["conveyor"]
    assert saved["peers"] == {"vllm": {"skipped": "skipped (vLLM environment: x)"}}


def test_metrics_of_vllms_server_are_read():
    page = "\n".join([
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
        'vllm:request_num_preemptions_bucket{engine="0",le="+Inf",model_name="m"} 9.0',
        'vllm:request_num_preemptions_count{engine="0",model_name="m"} 9.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 150.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
    ])
    assert serving.preemptions_from_metrics(page) == 3.0
    assert serving.prefix_cache_from_metrics(page) == (150.0, 200.0)


@pytest.mark.slow
def test_gguf_converts_to_a_bf16_directory_with_the_same_weights(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.bench.peers_transformers import load_model
    from conveyor.model.loader import default_model_path

    monkeypatch.setenv("CONVEYOR_PEER_ENVS", str(tmp_path))
    gguf = default_model_path()
    python = Path(sys.executable)  # the converter needs only torch, transformers and accelerate
    out = peers_vllm.converted_model(gguf, python)
    assert out.parent == tmp_path / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                      out.iterdir()}
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.dtype == torch.bfloat16
    reference = load_model(gguf, "bfloat16").state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert AutoTokenizer.from_pretrained(out).encode("Hello world") == \
        AutoTokenizer.from_pretrained(str(Path(gguf).parent),
                                      gguf_file=Path(gguf).name).encode("Hello world")
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert peers_vllm.converted_model(gguf, python) == out  # cached: not written again
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_driver_counts_the_rss_of_its_child_processes():
    import subprocess

    from conveyor.bench import vllm_driver

    alone = vllm_driver.tree_rss_kib(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = bytearray(64 << 20); sys.stdout.write('x');"
                              " sys.stdout.flush(); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        child.stdout.read(1)
        assert vllm_driver.tree_rss_kib(os.getpid()) > alone + 60 * 1024
    finally:
        child.kill()
        child.wait()


def test_report_prints_vllms_load_time_and_settings(capsys):
    from conveyor.bench.report import Measurement, SystemResult

    settings = {"max_num_batched_tokens": 4096, "block_size": 128,
                "env": {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0,1"}}
    rows = [SystemResult("conveyor", "bfloat16", [Measurement(10.0, 100, 1000)]),
            SystemResult("vllm", "bfloat16, vLLM 0.32.0", [Measurement(20.0, 1100, 1000)],
                         load_s=88.0, extra={"vllm_version": "0.32.0", "settings": settings,
                                             "cached_prompt_tokens": [1024]}),
            SystemResult("vllm", "bfloat16", skipped="skipped (vLLM environment: x)")]
    throughput.print_report({"results": [r.to_dict() for r in rows]}, "W1")
    out = capsys.readouterr().out
    assert "| vllm | bfloat16, vLLM 0.32.0 | 50.0 / 50.0 | 105 / 105 |" in out
    assert "| 0.50x |" in out
    assert "| vllm | bfloat16 | skipped (vLLM environment: x) |" in out
    assert ("vllm 0.32.0: loaded in 88s (its torch.compile warm-up included); "
            "max_num_batched_tokens 4096, block size 128, KV cache 4 GiB, OpenMP threads on "
            "cores 0,1") in out
    assert "vllm: prefix cache hits 1,024 of 1,100 prompt tokens" in out


def test_vllm_is_skipped_against_conveyor_on_a_gpu(monkeypatch):
    monkeypatch.setattr(peers_vllm, "skip_reason", lambda: pytest.fail("must not build"))
    row = peers_vllm.run(PeerJob("vllm", "m.gguf", "W1", 0, 2, 1, "bfloat16", 64, device="cuda"))
    assert row.skipped == ("skipped (the vLLM peer is its CPU build, vllm-cpu; Conveyor ran "
                           "on cuda)")


def test_vllm_server_that_fails_to_start_gives_the_root_cause(monkeypatch, tmp_path):
    monkeypatch.setattr(peers_vllm, "skip_reason", lambda: None)
    monkeypatch.setattr(peers_vllm, "converted_model", lambda path: tmp_path)
    monkeypatch.setattr(peers_vllm, "server_command", lambda *a: [
        sys.executable, "-c", "raise ValueError('no CPU backend for this dtype')"])
    runs, info = serving.run_vllm_sweep(_serve_args(["--spawn", "--compare", "vllm"]))
    assert runs == []
    assert info["skipped"].startswith("failed (ValueError: no CPU backend for this dtype; "
                                      "vLLM's OpenAI server exited with 1 before it was ready")
