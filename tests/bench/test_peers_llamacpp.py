"""The llama.cpp peers' plumbing, without llama.cpp: the environment, the driver protocol, the skip
path.

The driver (``llamacpp_driver.py``, the file the bench ships) runs in a subprocess whose "peer
environment" is this interpreter behind a wrapper that puts a small fake ``llama_cpp`` package on
its path: the fake samples token 7 (below every workload prompt's ids), returns logits that are a
function of each input token, and records what it was given, so the tests check the exact token
ids and settings that crossed the process boundary. The last tests run the real environment and
skip where it is not built (``CONVEYOR_PEER_ENVS``).
"""

import json
from pathlib import Path

import pytest

from conveyor.bench import peers_llamacpp, throughput
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
