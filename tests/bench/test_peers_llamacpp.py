"""The llama.cpp peers' plumbing, without llama.cpp: the environment, the driver protocol, the skip
path, and the accuracy row.

The driver (``llamacpp_driver.py``, the file the bench ships) runs in a subprocess whose "peer
environment" is this interpreter behind a wrapper that puts a small fake ``llama_cpp`` package on
its path: the fake samples token 7 (below every workload prompt's ids), returns logits that are a
function of each input token, and records what it was given, so the tests check the exact token
ids and settings that crossed the process boundary. The last tests run the real environment and
skip where it is not built (``CONVEYOR_PEER_ENVS``).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.bench import accuracy, llamacpp_driver, peers_llamacpp, throughput
from conveyor.bench.peers import WARMUP_SEED_OFFSET, PeerJob
from conveyor.bench.workloads import make_workload, warmup_workload

VOCAB = 49152
SAMPLED = 7  # the fake's greedy token: workload prompts draw from 256 up

# llama_cpp/llama_cpp.py: the C bindings (the package re-exports them)
FAKE_C_API = '''
import ctypes, json, os, sys, time

import numpy as np

SEEN = os.environ["FAKE_LLAMA_LOG"]
VOCAB = int(os.environ.get("FAKE_LLAMA_VOCAB", "49152"))
CONVEYOR_IMPORTED = any(m == "conveyor" or m.startswith("conveyor.") for m in sys.modules)


def _log(kind, **payload):
    with open(SEEN, "a") as f:
        f.write(json.dumps({"kind": kind, **payload}) + "\\n")


class _Struct:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def fake_logits(tokens):
    """[len(tokens), VOCAB]: row i a function of the token that row's position read."""
    t = np.asarray(tokens, dtype=np.int64)[:, None]
    return (((t + np.arange(VOCAB)[None, :]) % 13) * 0.25).astype(np.float32)


def llama_backend_init():
    pass


def llama_log_callback(fn):
    return fn


def llama_log_set(callback, user_data):
    pass


def llama_print_system_info():
    return b"CPU : FAKE = 1 | "


def llama_version():
    return b"0.0.0-fake"


def llama_model_default_params():
    return _Struct(use_extra_bufts=True)


def llama_model_load_from_file(path, params):
    if os.environ.get("FAKE_LLAMA_FAIL"):
        raise ValueError(os.environ["FAKE_LLAMA_FAIL"])
    _log("load", path=path.decode(), use_extra_bufts=params.use_extra_bufts,
         conveyor_imported=CONVEYOR_IMPORTED, virtual_env=os.environ.get("VIRTUAL_ENV"))
    return _Struct(vocab=_Struct(n=VOCAB))


def llama_model_get_vocab(model):
    return model.vocab


def llama_vocab_n_tokens(vocab):
    return vocab.n


def llama_context_default_params():
    return _Struct(n_ctx=0, n_batch=0, n_ubatch=0, n_seq_max=1, n_threads=0, n_threads_batch=0,
                   kv_unified=False)


def llama_init_from_model(model, params):
    _log("context", **params.__dict__)
    return _Struct(memory=_Struct(), outputs=[])


def llama_get_memory(ctx):
    return ctx.memory


def llama_memory_clear(memory, data):
    _log("clear")


def llama_memory_seq_rm(memory, seq, p0, p1):
    pass


def llama_batch_init(n, embd, n_seq_max):
    return _Struct(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                   seq_id=[[0] for _ in range(n)], logits=[False] * n)


def llama_batch_free(batch):
    pass


def llama_decode(ctx, batch):
    n = batch.n_tokens
    rows = [i for i in range(n) if batch.logits[i]]
    _log("decode", tokens=batch.token[:n], pos=batch.pos[:n],
         seq=[batch.seq_id[i][0] for i in range(n)], logits=rows)
    ctx.outputs = [batch.token[i] for i in rows]
    time.sleep(0.001)
    return 0


def llama_get_logits(ctx):
    ctx.logits = fake_logits(ctx.outputs)  # kept alive as long as the pointer is read
    return ctx.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def llama_sampler_chain_default_params():
    return _Struct()


def llama_sampler_chain_init(params):
    return _Struct()


def llama_sampler_init_greedy():
    return _Struct()


def llama_sampler_chain_add(chain, sampler):
    pass


def llama_sampler_sample(sampler, ctx, index):
    return 7


def llama_sampler_free(sampler):
    pass


def llama_free(ctx):
    pass


def llama_model_free(model):
    pass
'''

# llama_cpp/__init__.py: as the real one, Llama reads its model parameters from the bindings
FAKE_PACKAGE = '''
import time

from .llama_cpp import *
from .llama_cpp import _log
from . import llama_cpp

__version__ = "0.0-fake"


class Llama:
    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose,
                 logits_all, draft_model):
        params = llama_cpp.llama_model_default_params()
        _log("llama", model_path=model_path, n_ctx=n_ctx, n_threads=n_threads,
             logits_all=logits_all, num_pred_tokens=draft_model.num_pred_tokens,
             use_extra_bufts=params.use_extra_bufts)

    def n_vocab(self):
        return llama_cpp.VOCAB

    def generate(self, tokens, top_k, top_p, min_p, temp, repeat_penalty, reset):
        _log("generate", prompt=list(tokens), top_k=top_k, temp=temp, reset=reset)
        while True:
            time.sleep(0.001)
            yield 7

    def close(self):
        pass
'''

FAKE_SPECULATIVE = '''
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens):
        self.num_pred_tokens = num_pred_tokens
'''


@pytest.fixture
def fake_llama_env(tmp_path, monkeypatch, fake_peer_env):
    """llama.cpp's environment, ready, whose Python is this one with the fake on its path."""
    fake_peer_env(peers_llamacpp, {"llama_cpp/__init__.py": FAKE_PACKAGE,
                                   "llama_cpp/llama_cpp.py": FAKE_C_API,
                                   "llama_cpp/llama_speculative.py": FAKE_SPECULATIVE})
    log = tmp_path / "fake-llama.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setattr(peers_llamacpp, "vocab_size", lambda path: VOCAB)
    return log


def _seen(log: Path, kind: str | None = None) -> list[dict]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in events if kind is None or e["kind"] == kind]


def _requests_decoded(log: Path) -> list[tuple[list[int], int]]:
    """Each request the fake decoded, in admission order: (its prompt, tokens generated). A
    request starts with a token at position 0 of its slot; generated tokens come back as 7s."""
    requests: list[tuple[list[int], int]] = []
    current: dict[int, int] = {}  # slot -> index in requests
    for event in _seen(log, "decode"):
        for token, pos, seq in zip(event["tokens"], event["pos"], event["seq"], strict=True):
            if pos == 0:
                current[seq] = len(requests)
                requests.append(([], 1))  # the last sampled token is never fed back
            prompt, generated = requests[current[seq]]
            if token == SAMPLED:
                requests[current[seq]] = (prompt, generated + 1)
            else:
                prompt.append(token)
    return requests


def test_driver_runs_the_workloads_exact_requests(fake_llama_env):
    log = fake_llama_env
    job = PeerJob("llamacpp", "model.gguf", "W1", 5, 3, 2, "bfloat16", 16, threads=3)
    result = peers_llamacpp.run(job)

    (load,) = _seen(log, "load")
    assert load["path"] == str(Path("model.gguf").resolve())
    assert load["use_extra_bufts"] is False and load["conveyor_imported"] is False
    assert load["virtual_env"] == str(peers_llamacpp.ENV.path)
    (context,) = _seen(log, "context")
    warmup = warmup_workload(make_workload("W1", VOCAB, 5 + WARMUP_SEED_OFFSET, 3)).requests
    workloads = [make_workload("W1", VOCAB, 5 + k, 3) for k in range(2)]
    longest = max(len(r.prompt_token_ids) + r.max_tokens
                  for r in [*warmup, *workloads[0].requests, *workloads[1].requests])
    assert context == {"kind": "context", "n_ctx": 16 * (longest + 16), "n_batch": 2048,
                       "n_ubatch": 512, "n_seq_max": 16, "n_threads": 3, "n_threads_batch": 3,
                       "kv_unified": True}
    expected = [(r.prompt_token_ids, 4) for r in warmup]
    for w in workloads:
        expected += [(r.prompt_token_ids, r.max_tokens) for r in w.requests]
    assert _requests_decoded(log) == expected
    assert len(_seen(log, "clear")) == 3  # the warm-up and each repeat start from an empty cache

    assert result.skipped is None
    assert result.config == ("GGUF as shipped, 3 threads, 16 parallel sequences, "
                             "llama-cpp-python 0.0-fake")
    assert [m.output_tokens for m in result.repeats] == [3 * 128, 3 * 128]
    assert [m.prompt_tokens for m in result.repeats] == [w.num_prompt_tokens for w in workloads]
    assert all(m.wall_s > 0 for m in result.repeats)
    assert result.load_s >= 0 and result.peak_rss_mb > 0
    assert result.extra["llama_cpp_python_version"] == "0.0-fake"
    assert result.extra["system_info"] == "CPU : FAKE = 1 |"
    assert result.extra["llama_cpp_version"] == "0.0.0-fake"
    assert result.extra["settings"]["n_parallel"] == 16


def test_single_stream_times_each_token(fake_llama_env):
    log = fake_llama_env
    result = peers_llamacpp.run(PeerJob("llamacpp", "model.gguf", "S1", 0, None, 1, "float32"))
    (m,) = result.repeats
    assert m.output_tokens == 256 and m.prompt_tokens == 128
    assert 0 < m.ttft_s < m.wall_s
    assert 0 < m.decode_tokens_per_s < 255 / 0.001  # the fake sleeps 1 ms a decode
    assert _seen(log, "context")[0]["n_seq_max"] == 1
    assert "1 parallel sequences" in result.config


def test_a_single_stream_workload_of_several_requests_runs_them_all(fake_llama_env):
    result = peers_llamacpp.run(PeerJob("llamacpp", "model.gguf", "S1", 0, 3, 1, "float32"))
    (m,) = result.repeats
    assert m.output_tokens == 3 * 256 and m.ttft_s is None  # a batch through one slot
    assert [n for _, n in _requests_decoded(fake_llama_env)] == [4, 4, 256, 256, 256]


def test_prompt_lookup_runs_one_stream_with_its_proposals(fake_llama_env):
    log = fake_llama_env
    result = peers_llamacpp.run(PeerJob("llamacpp-lookup", "model.gguf", "C1", 2, None, 2,
                                        "float32", 6))
    (llama,) = _seen(log, "llama")
    assert (llama["num_pred_tokens"], llama["logits_all"]) == (6, True)
    assert llama["use_extra_bufts"] is False  # the AMX extra buffers stay off through Llama too
    prompts = [g["prompt"] for g in _seen(log, "generate")]
    assert prompts == [make_workload("C1", VOCAB, s, 1).requests[0].prompt_token_ids
                       for s in (2 + WARMUP_SEED_OFFSET, 2, 3)]
    assert all(g["temp"] == 0.0 and g["top_k"] == 1 for g in _seen(log, "generate"))
    assert [m.output_tokens for m in result.repeats] == [256, 256]
    assert all(m.ttft_s > 0 and m.decode_tokens_per_s > 0 for m in result.repeats)
    assert result.config.startswith("GGUF as shipped, 2 threads, prompt lookup, 6 tokens proposed")


def test_driver_failure_names_the_root_cause(fake_llama_env, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "unknown model architecture: 'mamba9'")
    with pytest.raises(RuntimeError, match="llama.cpp driver exit 1: ValueError: unknown model "
                                           "architecture"):
        peers_llamacpp.run(PeerJob("llamacpp", "model.gguf", "S1", 0, None, 1, "float32"))


def test_a_vocabulary_that_differs_from_the_prompts_is_refused(fake_llama_env, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_VOCAB", "32000")
    with pytest.raises(RuntimeError, match="vocabulary of 32000 tokens"):
        peers_llamacpp.run(PeerJob("llamacpp", "model.gguf", "S1", 0, None, 1, "float32"))


def test_an_hf_directory_is_no_model_for_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.setattr(peers_llamacpp, "skip_reason", lambda: pytest.fail("must not build"))
    row = peers_llamacpp.run(PeerJob("llamacpp", str(tmp_path), "W1", 0, 2, 1, "float32", 16))
    assert row.skipped == "skipped (llama.cpp reads GGUF files; the model is an HF directory)"


def test_llama_cpps_version_goes_into_the_provenance():
    rows = [{"system": "conveyor", "repeats": [{}], "extra": {}},
            {"system": "llamacpp", "repeats": [{}], "extra": {
                "llama_cpp_python_version": "0.3.36"}},
            {"system": "vllm", "repeats": [], "extra": {}}]
    assert throughput.ran_peer_versions(rows) == {"llama-cpp-python": "0.3.36"}


# ----------------------------------------------------------------------------- accuracy

def test_window_figures_match_torch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 300, generator=gen) * 3
    reference = torch.log_softmax(torch.randn(10, 300, generator=gen, dtype=torch.float64) * 3, -1)
    nxt = torch.randint(0, 300, (10,), generator=gen)
    q = torch.log_softmax(logits.double(), -1)
    kl, agree, nll = llamacpp_driver.window_figures(logits.numpy(), reference.numpy(),
                                                    nxt.tolist(), rows=3)
    assert kl == pytest.approx(float((reference.exp() * (reference - q)).sum()), rel=1e-9)
    assert agree == int((reference.argmax(-1) == q.argmax(-1)).sum())
    assert nll == pytest.approx(-float(q.gather(1, nxt[:, None]).sum()), rel=1e-9)


def _fake_logits(tokens: list[int]) -> torch.Tensor:
    """The fake's logits (FAKE_C_API's fake_logits)."""
    t = torch.tensor(tokens)[:, None]
    return ((t + torch.arange(VOCAB)[None, :]) % 13) * 0.25


def test_llama_cpp_compares_with_float_over_the_same_windows(fake_llama_env, tmp_path):
    log = fake_llama_env
    text = accuracy.DEFAULT_TEXT.read_text()
    keep = accuracy.ReferenceFiles(tmp_path)
    result = accuracy.measure(None, torch.float32, text, "int8", window=20, max_tokens=45,
                              keep=keep)
    windows = [w["token_ids"] for w in keep.windows]
    assert [len(w) for w in windows] == [20, 20, 5]
    row, info = accuracy.llama_cpp_accuracy("model.gguf", keep, result.float_perplexity)

    # every window one prefill from position 0, without its last token, every row's logits
    decodes = _seen(log, "decode")
    assert [d["tokens"] for d in decodes] == [w[:-1] for w in windows]
    assert all(d["pos"] == list(range(len(d["tokens"]))) for d in decodes)
    assert all(d["logits"] == list(range(len(d["tokens"]))) for d in decodes)
    (context,) = _seen(log, "context")
    assert (context["n_ctx"], context["n_batch"], context["n_ubatch"]) == (19, 19, 19)

    kl, agree, nll = 0.0, 0, 0.0
    for w in keep.windows:
        p = torch.from_numpy(np.load(w["reference"])).double()
        ids = w["token_ids"]
        q = torch.log_softmax(_fake_logits(ids[:-1]).double(), -1)
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        nll -= float(q.gather(1, torch.tensor(ids[1:])[:, None]).sum())
    assert row.method == "llama.cpp" and row.tokens == result.tokens == 42
    assert row.kl_mean == pytest.approx(kl / 42, rel=1e-6)
    assert row.top1_agreement == agree / 42
    assert row.perplexity == pytest.approx(math.exp(nll / 42), rel=1e-6)
    assert row.float_perplexity == result.float_perplexity
    assert info["llama_cpp_python_version"] == "0.0-fake"


def test_reference_files_hold_floats_log_probs(tmp_path):
    keep = accuracy.ReferenceFiles(tmp_path)
    log_probs = torch.log_softmax(torch.randn(4, 10, dtype=torch.float64), -1)
    keep.add([5, 6, 7, 8, 9], log_probs)
    (w,) = keep.windows
    saved = np.load(w["reference"], mmap_mode="r")
    assert w["token_ids"] == [5, 6, 7, 8, 9] and saved.dtype == np.float32
    assert np.allclose(saved, log_probs.numpy(), rtol=1e-6)


def _measure_without_a_model(monkeypatch) -> None:
    """``accuracy.measure`` stubbed: two windows of made-up float log-probabilities (the CLI's
    plumbing, not the model's figures)."""
    def measure(path, dtype, text, method, window, max_tokens, keep=None):
        gen = torch.Generator().manual_seed(0)
        ids = list(range(300, 300 + 2 * window))
        for w in accuracy.windows(ids, window):
            if keep is not None:
                keep.add(w, torch.log_softmax(torch.randn(len(w) - 1, VOCAB, generator=gen,
                                                          dtype=torch.float64), -1))
        return accuracy.Accuracy(method, 2 * (window - 1), 30.0, 29.0, 0.01, 0.9)

    monkeypatch.setattr(accuracy, "measure", measure)


def test_accuracy_cli_prints_and_writes_the_llama_cpp_row(fake_llama_env, monkeypatch, tmp_path,
                                                          capsys):
    from conveyor.entrypoints.cli import main

    _measure_without_a_model(monkeypatch)
    path = tmp_path / "accuracy.json"
    assert main(["bench", "accuracy", "--window", "20", "--compare", "llamacpp",
                 "--json", str(path)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("llama.cpp")]
    assert row.split()[1] == "38"
    assert len(_seen(fake_llama_env, "decode")) == 2
    saved = json.loads(path.read_text())
    assert [r["method"] for r in saved["results"]] == ["int8", "llama.cpp"]
    assert saved["results"][1]["tokens"] == 38 and saved["results"][1]["float_perplexity"] == 29.0
    assert saved["provenance"]["peers"] == {"llama-cpp-python": "0.0-fake"}


def test_accuracy_cli_says_why_llama_cpp_is_skipped(monkeypatch, tmp_path, capsys):
    from conveyor.entrypoints.cli import main

    _measure_without_a_model(monkeypatch)
    monkeypatch.setattr(peers_llamacpp, "skip_reason",
                        lambda: "skipped (llama.cpp environment: no compiler)")
    path = tmp_path / "accuracy.json"
    assert main(["bench", "accuracy", "--window", "20", "--compare", "llamacpp",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp       skipped (llama.cpp environment: no compiler)" in out
    saved = json.loads(path.read_text())
    assert saved["results"][1] == {"method": "llama.cpp",
                                   "skipped": "skipped (llama.cpp environment: no compiler)"}
    with pytest.raises(SystemExit, match="unknown peer 'vllm'"):
        main(["bench", "accuracy", "--compare", "vllm"])


def test_accuracy_cli_says_why_llama_cpp_failed(fake_llama_env, monkeypatch, capsys):
    from conveyor.entrypoints.cli import main

    _measure_without_a_model(monkeypatch)
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "no such tensor")
    assert main(["bench", "accuracy", "--window", "20", "--compare", "llamacpp"]) == 0
    assert ("llama.cpp       failed (llama.cpp driver exit 1: ValueError: no such tensor)"
            in capsys.readouterr().out)


# ----------------------------------------------------------------------------- the real one

real_env = pytest.mark.skipif(not peers_llamacpp.ENV.ready(),
                              reason=f"llama.cpp's environment is not built in "
                                     f"{peers_llamacpp.ENV.path} (CONVEYOR_PEER_ENVS)")


@real_env
@pytest.mark.slow
def test_real_llama_cpp_generates_every_token():
    from conveyor.model.loader import default_model_path

    result = peers_llamacpp.run(PeerJob("llamacpp", default_model_path(), "W1", 0, 3, 1,
                                        "float32", 2))
    assert result.skipped is None, result.skipped
    assert result.repeats[0].output_tokens == 3 * 128
    assert result.extra["llama_cpp_python_version"] == peers_llamacpp.LLAMA_CPP_PACKAGE.split(
        "==")[1]


@real_env
@pytest.mark.slow
def test_real_llama_cpp_is_close_to_float(tmp_path):
    from conveyor.model.loader import default_model_path

    keep = accuracy.ReferenceFiles(tmp_path)
    result = accuracy.measure(None, torch.float32, accuracy.DEFAULT_TEXT.read_text(), "int8",
                              window=64, max_tokens=128, keep=keep)
    row, _ = accuracy.llama_cpp_accuracy(default_model_path(), keep, result.float_perplexity)
    assert row.tokens == 126
    assert 0 < row.kl_mean < 0.05 and row.top1_agreement > 0.85
    assert abs(math.log(row.perplexity / row.float_perplexity)) < 0.1
