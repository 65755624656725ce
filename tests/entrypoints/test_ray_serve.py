"""`conveyor serve --data-parallel-size 2`: two replicas on a local Ray instance (2 CPUs, one torch
thread each) behind one OpenAI endpoint, exercised over real HTTP.

One fleet serves the whole module (starting Ray and loading two replicas is the slow part), with
LoRA enabled and one adapter from the start; the router comparison starts a second, round_robin
fleet; the replica-kill test runs last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_server_errors import CASES, _check

from conftest import ENGINE_KWARGS, ServerProcess, start_fleet

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLEET_FLAGS = ["--data-parallel-size", "2", "--ray-num-cpus", "2", "--threads-per-replica", "1"]
GROUPS, ROUNDS, PREFIX_BLOCKS = 5, 3, 8
LORA_ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}  # the fleet's flags
LORA_PROMPT = "Once upon a time"


def _start(tmp_path_factory, router: str, flags: list[str] | None = None) -> ServerProcess:
    return start_fleet(tmp_path_factory, FLEET_FLAGS + ["--router", router] + (flags or []))


def _write_adapter(model_config, path: str, seed: int) -> str:
    """A rank-4 PEFT adapter on every layer's q_proj and v_proj of the served model, large
    enough to change its greedy text."""
    import json

    import torch
    from safetensors.torch import save_file

    from conveyor.lora.adapter import module_shapes

    shapes = module_shapes(model_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module in ("q_proj", "v_proj"):
            out, inp = shapes[module]
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.1 * torch.randn(4, inp, generator=gen)
            tensors[f"{name}.lora_B.weight"] = 0.1 * torch.randn(out, 4, generator=gen)
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none",
                   "target_modules": ["q_proj", "v_proj"]}, f)
    return path


@pytest.fixture(scope="module")
def lora_dirs(llm, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {name: _write_adapter(llm.llm_engine.model_config, str(root / name), seed)
            for seed, name in enumerate(("sql", "chat"))}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, lora_dirs):
    s = _start(tmp_path_factory, "prefix_affinity",
               ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                "--lora-modules", f"sql={lora_dirs['sql']}", "--allow-runtime-lora",
                "--lora-root", os.path.dirname(lora_dirs["sql"])])
    try:
        yield s
    finally:
        assert s.stop() == 0, s.log()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=120,
                         max_retries=0)


def test_openai_client_completions_and_streams(fleet, llm, one_thread) -> None:
    from conveyor.core.sampling_params import SamplingParams

    client = _client(fleet)
    model = client.models.list().data[0].id
    prompt = "The three primary colors are"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      n=2)
    with one_thread():
        expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert [c.text for c in whole.choices] == [expected.outputs[0].text] * 2
    assert whole.usage.completion_tokens == 24
    chunks = list(client.completions.create(prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, model=model))
    assert "".join(c.choices[0].text for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0, stream=True))
    assert chat.choices[0].message.content == streamed and streamed
    routed = fleet.metrics()
    per_replica = [v for k, v in routed.items() if k.startswith("conveyor:router_requests_total")]
    assert len(per_replica) == 2 and sum(per_replica) >= 4  # n=2 is one request


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_requests_get_the_single_process_errors(fleet, path, body, status, fragment,
                                                    param) -> None:
    resp = httpx.post(fleet.base_url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"})
    _check(resp, status, fragment, param)


def test_health_and_metrics_cover_every_replica(fleet) -> None:
    health = httpx.get(fleet.base_url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["healthy_replicas"] == 2
    assert all(r["status"] == "ok" and r["pid"] > 0 for r in health["replicas"].values())
    m = fleet.metrics()
    for replica in health["replicas"]:
        assert f"conveyor:num_requests_running{{replica={replica}}}" in m
        assert f"conveyor:router_requests_total{{replica={replica}}}" in m
    assert m["conveyor:replicas_live"] == 2


def _served_per_replica(fleet) -> dict[str, tuple[float, float]]:
    """Per replica: (requests the router sent it, requests its engine finished)."""
    m = fleet.metrics()
    replicas = httpx.get(fleet.base_url + "/health", timeout=30).json()["replicas"]
    return {r: (m[f"conveyor:router_requests_total{{replica={r}}}"],
                sum(v for k, v in m.items() if k.startswith("conveyor:request_success_total{")
                    and f"replica={r}" in k)) for r in replicas}


def test_each_call_reaches_the_replica_it_names(fleet) -> None:
    """Idle, the fleet answers /health 25 times with each replica's own PID (two distinct PIDs,
    the same one per replica every time); busy with concurrent requests, each replica's engine
    finished exactly the requests the router sent it."""
    pids: dict[str, set[int]] = {}
    for _ in range(25):
        replicas = httpx.get(fleet.base_url + "/health", timeout=30).json()["replicas"]
        assert len({r["pid"] for r in replicas.values()}) == 2, replicas
        for name, r in replicas.items():
            pids.setdefault(name, set()).add(r["pid"])
    assert all(len(p) == 1 for p in pids.values()), pids
    before = _served_per_replica(fleet)
    client = _client(fleet)
    model = client.models.list().data[0].id
    threads = [threading.Thread(target=client.completions.create, kwargs=dict(
        model=model, prompt=f"Request {i}: name a colour.", max_tokens=4, temperature=0.0))
        for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = _served_per_replica(fleet)
    sent = {r: after[r][0] - before[r][0] for r in after}
    served = {r: after[r][1] - before[r][1] for r in after}
    assert sum(sent.values()) == 8 and sent == served, (sent, served)


def test_client_disconnect_aborts_on_the_replica(fleet) -> None:
    def aborted() -> float:
        return sum(v for k, v in fleet.metrics().items()
                   if k.startswith("conveyor:request_success_total{finished_reason=abort"))

    before = aborted()
    with httpx.stream("POST", fleet.base_url + "/v1/completions", timeout=60,
                      json={"prompt": "Count to one thousand:", "max_tokens": 400,
                            "stream": True, "ignore_eos": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the replica never aborted the request"
        time.sleep(0.5)


def test_lora_adapters_serve_from_every_replica_with_affinity(fleet, lora_dirs,
                                                             one_thread) -> None:
    """``--lora-modules`` and a run-time load reach both replicas (a bad adapter reaches none);
    /v1/models lists them; each adapter's requests stay on one replica and answer as a
    single-process engine does; an unloaded adapter is a 404 and leaves every replica."""
    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.llm import LLM
    from conveyor.lora.request import LoRARequest

    url = fleet.base_url
    loaded = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "chat", "lora_path": lora_dirs["chat"]})
    assert loaded.status_code == 200, loaded.text
    empty = os.path.join(os.path.dirname(lora_dirs["sql"]), "empty")  # under --lora-root
    os.makedirs(empty, exist_ok=True)
    bad = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                     json={"lora_name": "bad", "lora_path": empty})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    models = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    base = next(name for name, m in models.items() if m["parent"] is None)
    assert set(models) == {base, "sql", "chat"}
    assert models["chat"]["parent"] == base and models["chat"]["root"] == lora_dirs["chat"]
    replicas = httpx.get(url + "/health", timeout=30).json()["replicas"]
    assert [r["loras"] for r in replicas.values()] == [["chat", "sql"]] * 2

    before = fleet.metrics()
    texts: dict[str, set[str]] = {}
    for model in ("sql", "chat", base) * 2:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": LORA_PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        texts.setdefault(model, set()).add(r.json()["choices"][0]["text"])
    after = fleet.metrics()
    for name in ("sql", "chat"):
        key = "conveyor:router_lora_requests_total{{lora_name={},replica={}}}"
        sent = sorted(after.get(key.format(name, r), 0) - before.get(key.format(name, r), 0)
                      for r in replicas)
        assert sent == [0, 2], (name, sent)  # both on the adapter's home

    params = SamplingParams(max_tokens=6, temperature=0)
    expected = {}
    with one_thread():
        llm = LLM(**ENGINE_KWARGS, **LORA_ENGINE)
        for i, model in enumerate(("sql", "chat", base)):
            lora = LoRARequest(model, i + 1, lora_dirs[model]) if model in lora_dirs else None
            expected[model] = {llm.generate(LORA_PROMPT, params, lora_request=lora,
                                            use_tqdm=False)[0].outputs[0].text}
    assert texts == expected
    assert len({t for ts in texts.values() for t in ts}) == 3  # the adapters change the text

    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert gone.status_code == 200, gone.text
    missing = httpx.post(url + "/v1/completions", timeout=60,
                         json={"model": "chat", "prompt": LORA_PROMPT, "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    assert models == [base, "sql"]
    replicas = httpx.get(url + "/health", timeout=30).json()["replicas"]
    assert [r["loras"] for r in replicas.values()] == [["sql"]] * 2


def _shared_prefix_hit_rate(server: ServerProcess) -> float:
    """GROUPS prompts sharing PREFIX_BLOCKS blocks each, ROUNDS requests per group, one request
    at a time (round_robin's order is then fixed: with an odd GROUPS a group alternates between
    the two replicas): the prefix-cache hit rate over the fleet."""

    def totals() -> tuple[float, float]:
        m = server.metrics()
        hits = sum(v for k, v in m.items() if k.startswith("conveyor:prefix_cache_hits_total"))
        queries = sum(v for k, v in m.items()
                      if k.startswith("conveyor:prefix_cache_queries_total"))
        return hits, queries

    hits0, queries0 = totals()
    salt = int(time.time()) % 1000  # prefixes no earlier request used
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for r in range(ROUNDS):
            for g in range(GROUPS):
                prefix = [(1000 + 37 * g + 11 * salt + i) % 40000
                          for i in range(16 * PREFIX_BLOCKS)]
                suffix = [(20000 + 101 * r + 7 * g + i) % 40000 for i in range(16)]
                resp = client.post("/v1/completions", json={"prompt": prefix + suffix,
                                                            "max_tokens": 2})
                assert resp.status_code == 200, resp.text
    hits1, queries1 = totals()
    return (hits1 - hits0) / (queries1 - queries0)


def test_prefix_affinity_hit_rate_beats_round_robin(fleet, tmp_path_factory) -> None:
    affinity = _shared_prefix_hit_rate(fleet)
    rr_fleet = _start(tmp_path_factory, "round_robin")
    try:
        round_robin = _shared_prefix_hit_rate(rr_fleet)
    finally:
        assert rr_fleet.stop() == 0, rr_fleet.log()
    print(f"prefix-cache hit rate: prefix_affinity {affinity:.3f}, round_robin {round_robin:.3f}")
    assert affinity > 0.5
    assert affinity >= 1.8 * round_robin


def test_killing_a_replica_loses_no_request_silently(fleet) -> None:
    health = httpx.get(fleet.base_url + "/health", timeout=30).json()
    victim = next(iter(health["replicas"].values()))["pid"]
    results: list[str] = []
    started = threading.Barrier(7)

    def stream(i: int) -> None:
        text, outcome = "", "truncated"
        try:
            with httpx.stream("POST", fleet.base_url + "/v1/completions", timeout=120,
                              json={"prompt": f"Story number {i}:", "max_tokens": 96,
                                    "ignore_eos": True, "stream": True}) as resp:
                first = True
                for line in resp.iter_lines():
                    if first and line.startswith("data: "):
                        first = False
                        started.wait(timeout=60)
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        assert chunk["error"]["code"] == "replica_died", chunk
                        outcome = "error"
                    elif chunk["choices"][0]["finish_reason"] == "length":
                        outcome = "finished"
                    else:
                        text += chunk["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001 - recorded, checked below
            outcome = f"exception {e!r}"
        results.append(outcome)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # every stream has its first chunk: the kill is mid-stream
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == sorted(r for r in results if r in ("finished", "error")), results
    assert "error" in results  # the victim's streams say so instead of ending short
    # The endpoint keeps serving: new requests go to the live replica (or the replacement).
    client = _client(fleet)
    model = client.models.list().data[0].id
    for _ in range(3):
        out = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 300
    while True:  # Ray Serve replaces the dead replica
        health = httpx.get(fleet.base_url + "/health", timeout=30).json()
        pids = [r.get("pid") for r in health["replicas"].values()]
        if health["healthy_replicas"] == 2 and victim not in pids:
            break
        assert time.monotonic() < deadline, health
        time.sleep(2)
    while True:  # the replacement gets the fleet's adapter
        health = httpx.get(fleet.base_url + "/health", timeout=30).json()
        if all(r.get("loras") == ["sql"] for r in health["replicas"].values()):
            break
        assert time.monotonic() < deadline, health
        time.sleep(1)
