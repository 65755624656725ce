"""`conveyor serve --pd 1:1`: one prefill and one decode replica (Ray Serve). Greedy and seeded
tokens through the OpenAI client equal the in-process engine's, streamed or not; the decode
replica loads the prompt's blocks and computes only the tail; a client leaving mid-request
frees everything on both replicas; killing the decode replica mid-request ends that request
with a clear error and the fleet serves the next ones."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from conftest import ServerProcess, start_fleet

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FLEET_FLAGS = ["--pd", "1:1", "--ray-num-cpus", "2", "--threads-per-replica", "1"]
PROMPT = ("A long time ago, in a small village between the mountains and the sea, there lived "
          "an old clockmaker who repaired every clock in the valley. One winter morning,")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    s = start_fleet(tmp_path_factory, FLEET_FLAGS)
    try:
        yield s
    finally:
        assert s.stop() == 0, s.log()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=120,
                         max_retries=0)


def _replicas(fleet) -> dict[str, dict]:
    """role -> that replica's /health entry (with its id)."""
    health = httpx.get(fleet.base_url + "/health", timeout=30).json()
    return {r["role"]: {**r, "id": rid} for rid, r in health["replicas"].items()
            if r["status"] == "ok"}


def _of(fleet, metrics: dict[str, float], name: str, role: str) -> float:
    rid = _replicas(fleet)[role]["id"]
    return sum(v for k, v in metrics.items()
               if k.startswith(f"conveyor:{name}{{") and f"replica={rid}" in k)


def test_tokens_equal_a_plain_run_and_the_decode_replica_loads_the_prompt(
        fleet, llm, one_thread) -> None:
    from conveyor.core.sampling_params import SamplingParams

    client = _client(fleet)
    model = client.models.list().data[0].id
    before = fleet.metrics()
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    after = fleet.metrics()
    with one_thread():
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    assert whole.choices[0].text == expected.outputs[0].text
    assert whole.usage.completion_tokens == len(expected.outputs[0].token_ids)
    n = whole.usage.prompt_tokens
    assert n == len(expected.prompt_token_ids) and n > 32
    # the decode replica loaded every full block of the prompt and computed only the tail
    loaded = (_of(fleet, after, "kv_transfer_loaded_blocks_total", "decode")
              - _of(fleet, before, "kv_transfer_loaded_blocks_total", "decode"))
    computed = (_of(fleet, after, "prompt_tokens_total", "decode")
                - _of(fleet, before, "prompt_tokens_total", "decode"))
    assert loaded == n // 16
    assert computed == n % 16 + 1
    assert _of(fleet, after, "kv_transfer_held_blocks", "decode") == 0

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)

    seeded = dict(max_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    got = client.completions.create(model=model, prompt=PROMPT + " the", **seeded)
    with one_thread():
        want = llm.generate([PROMPT + " the"], SamplingParams(**seeded))[0]
    assert got.choices[0].text == want.outputs[0].text

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0, stream=True))
    assert chat.choices[0].message.content == streamed and streamed


def _wait_idle(fleet, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        replicas = _replicas(fleet)
        m = fleet.metrics()
        if (all(r["running"] == 0 and r["waiting"] == 0 and r["kv_usage"] == 0
                for r in replicas.values())
                and _of(fleet, m, "kv_transfer_held_blocks", "decode") == 0):
            return
        assert time.monotonic() < deadline, (replicas, m)
        time.sleep(0.5)


@pytest.mark.parametrize("chunks_read", [1, 3], ids=["after-prefill", "mid-decode"])
def test_a_client_leaving_frees_everything(fleet, chunks_read) -> None:
    with httpx.stream("POST", fleet.base_url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 300, "stream": True,
                            "ignore_eos": True}) as resp:
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == chunks_read:
                    break
    _wait_idle(fleet)


def test_killing_the_decode_replica_mid_request_is_a_clear_error(fleet) -> None:
    victim = _replicas(fleet)["decode"]["pid"]
    outcome = "truncated"
    with httpx.stream("POST", fleet.base_url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
                            "stream": True}) as resp:
        seen = 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert chunk["error"]["code"] == "replica_died", chunk
                outcome = "error"
                continue
            seen += 1
            if seen == 3:  # the decode replica is producing tokens
                os.kill(victim, signal.SIGKILL)
            if chunk["choices"][0]["finish_reason"] is not None:
                outcome = "finished"
    assert outcome == "error"
    # The fleet serves the next requests (once Serve has replaced the dead replica).
    client = _client(fleet)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + 400
    while True:
        try:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
            assert out.choices[0].finish_reason == "length"
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503, e
            assert time.monotonic() < deadline
            time.sleep(2)
    assert _replicas(fleet)["decode"]["pid"] != victim
