"""LoRA adapters on a real `conveyor serve` over a tiny random Llama: adapters from
``--lora-modules`` and from ``/v1/load_lora_adapter`` answer as their merged models do, through
the official ``openai`` client naming them as ``model``; ``/v1/models`` lists them; unloading
while requests run loses none; bad adapters and unknown names are clear 4xx. Loading at run time
needs ``--allow-runtime-lora``, reads only under ``--lora-root``, and no answer tells a client
whether a path outside it exists."""

from __future__ import annotations

import json
import os
import threading

import httpx
import openai
import pytest

from conveyor.engine.llm import LLM
from tiny_models import save_lora_models

PROMPT = "w5 w9 w17 w40 w41 w7"
ENGINE = {"dtype": "float32", "num_gpu_blocks": 64, "block_size": 8, "max_model_len": 128}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return save_lora_models(str(tmp_path_factory.mktemp("lora")))


@pytest.fixture(scope="module")
def served(start_server, models):
    return start_server(["--model", models["base"], "--dtype", "float32", "--enable-lora",
                         "--max-loras", "2", "--lora-modules", f"qv8={models['qv8']}",
                         f"all16={models['all16']}", "--max-model-len", "128",
                         "--allow-runtime-lora", "--lora-root", os.path.dirname(models["base"])])


def _merged_text(models: dict[str, str], name: str, max_tokens: int = 10) -> str:
    from conveyor.core.sampling_params import SamplingParams

    llm = LLM(models[name + "_merged"], **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def test_adapters_answer_as_their_merged_models(served, models) -> None:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=60)
    listed = {m.id: m for m in client.models.list().data}
    base = next(m for m in listed.values() if m.model_extra.get("parent") is None).id
    assert {"qv8", "all16"} <= set(listed) and listed["qv8"].model_extra["parent"] == base
    loaded = httpx.post(served.base_url + "/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "ko4", "lora_path": models["ko4"]})
    assert loaded.status_code == 200, loaded.text
    texts = {}
    for name in ("qv8", "all16", "ko4"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        texts[name] = r.choices[0].text
        assert texts[name] == _merged_text(models, name), name
    assert len(set(texts.values())) == 3
    metrics = httpx.get(served.base_url + "/metrics", timeout=60).text
    installs = next(line for line in metrics.splitlines()
                    if line.startswith("conveyor:lora_slot_installs_total"))
    assert float(installs.split()[-1]) >= 3  # three adapters through two slots
    assert 'conveyor:lora_requests_info{max_lora="2"' in metrics


def test_unloading_while_requests_run_loses_none(served, models) -> None:
    chunks: list[list[str]] = [[] for _ in range(4)]
    started = [threading.Event() for _ in range(4)]

    def ask(k: int) -> None:
        with httpx.stream("POST", served.base_url + "/v1/completions", timeout=120, json={
                "model": "all16", "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True,
                "temperature": 0, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks[k].append(line)
                    started[k].set()

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)  # every request is running under the adapter
    gone = httpx.post(served.base_url + "/v1/unload_lora_adapter", timeout=60,
                      json={"lora_name": "all16"})
    assert gone.status_code == 200, gone.text
    for t in threads:
        t.join(120)
    assert [len(c) for c in chunks] == [40] * 4  # each ran to its end under the adapter
    expected = _merged_text(models, "all16", 40)
    for c in chunks:
        assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in c) == expected
    missing = httpx.post(served.base_url + "/v1/completions", timeout=60,
                         json={"model": "all16", "prompt": PROMPT, "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    back = httpx.post(served.base_url + "/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "all16", "lora_path": models["all16"]})
    assert back.status_code == 200, back.text


def test_bad_adapters_are_clear_errors(served, models) -> None:
    """Under --lora-root a load that fails says why."""
    url = served.base_url
    empty = os.path.join(os.path.dirname(models["base"]), "empty")
    os.makedirs(empty, exist_ok=True)
    cases = [({"lora_name": "bad", "lora_path": empty}, 400, "adapter_config.json"),
             ({"lora_name": "rel", "lora_path": "empty"}, 400, "adapter_config.json"),
             ({"lora_name": "qv8", "lora_path": models["qv8"]}, 400, "already served"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for body, status, text in cases:
        r = httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == status and text in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert r.status_code == 404
    ok = httpx.post(url + "/v1/completions", json={"model": "qv8", "prompt": PROMPT,
                                                   "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def _load(url: str, path: str, name: str = "probe") -> dict:
    r = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_paths_outside_the_root_are_refused_alike(served, models, tmp_path) -> None:
    """Outside --lora-root: a directory that exists, a file, one that does not, a symlink from
    inside the root to outside and a ``..`` escape all get the very same answer."""
    link = os.path.join(os.path.dirname(models["base"]), "escape")
    if not os.path.islink(link):
        os.symlink("/etc", link)
    answers = [_load(served.base_url, path) for path in
               ("/etc", "/etc/passwd", "/no/such/dir", str(tmp_path), "escape",
                "../../../../etc", "a\x00b")]
    assert all(a == answers[0] for a in answers), answers
    assert answers[0]["code"] == "path_not_allowed" and "--lora-root" in answers[0]["message"]
    assert "/etc" not in answers[0]["message"]


def test_lone_surrogates_in_the_adapter_routes_name_the_field(served) -> None:
    for route, body, param in (
            ("load_lora_adapter", '{"lora_name": "x", "lora_path": "\\ud800"}', "lora_path"),
            ("load_lora_adapter", '{"lora_name": "\\udfff", "lora_path": "x"}', "lora_name"),
            ("unload_lora_adapter", '{"lora_name": "a\\ud800"}', "lora_name")):
        r = httpx.post(f"{served.base_url}/v1/{route}", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_unicode" and err["param"] == param, err


def test_runtime_loading_without_a_root_tells_no_reason(start_server, models, tmp_path) -> None:
    """With --allow-runtime-lora and no --lora-root any path may be tried, and every failure
    is one message: whether /etc exists (it does), holds no adapter, or /nowhere does not exist
    cannot be told apart; a real adapter still loads and the unload route works."""
    s = start_server(["--model", models["base"], "--dtype", "float32", "--enable-lora",
                      "--max-model-len", "128", "--allow-runtime-lora"])
    answers = [_load(s.base_url, path) for path in
               ("/etc", "/etc/passwd", "/nowhere", str(tmp_path), "/proc/self/environ")]
    assert all(a == answers[0] for a in answers), answers
    assert answers[0]["code"] == "path_not_usable"
    assert "adapter_config" not in answers[0]["message"]
    ok = httpx.post(s.base_url + "/v1/load_lora_adapter", timeout=60,
                    json={"lora_name": "ko4", "lora_path": models["ko4"]})
    assert ok.status_code == 200, ok.text
    gone = httpx.post(s.base_url + "/v1/unload_lora_adapter", timeout=60,
                      json={"lora_name": "ko4"})
    assert gone.status_code == 200, gone.text


def test_runtime_loading_is_off_by_default(server) -> None:
    """Without --allow-runtime-lora both routes are a 403 before the body is read."""
    for route, body in (("load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
                        ("unload_lora_adapter", {"lora_name": "a"})):
        r = httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=60)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "runtime_lora_disabled" and "--allow-runtime-lora" in err["message"]
        assert "/etc" not in err["message"]
