"""The pooling endpoints against a real `conveyor serve`: ``/v1/embeddings`` with the official
``openai`` client (base64 and float) equals ``LLM.embed`` on the same engine settings;
``/v1/score`` and ``/v1/rerank`` order documents as cosine similarity does; every bad input is a
400 in OpenAI's shape, and none of them stalls a stream running beside them."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

QUERY = "What is the capital of France?"
DOCS = ["Bananas are yellow and sweet.",
        "Paris is the capital and largest city of France.",
        "The train leaves at noon.",
        QUERY]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def _close(a: list[float], b: list[float]) -> bool:
    return F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item() > 0.9999


def test_embeddings_equal_the_offline_api(client, model, llm) -> None:
    texts = [QUERY, *DOCS]
    expected = llm.embed(texts, use_tqdm=False)
    got = client.embeddings.create(model=model, input=texts)  # the client asks for base64
    assert [d.index for d in got.data] == list(range(len(texts)))
    assert all(_close(d.embedding, e) for d, e in zip(got.data, expected, strict=True))
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(
        len(llm.get_tokenizer().encode(t)) for t in texts)
    floats = client.embeddings.create(model=model, input=DOCS[0], encoding_format="float")
    assert len(floats.data) == 1 and _close(floats.data[0].embedding, expected[1])
    ids = llm.get_tokenizer().encode(DOCS[1])
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert _close(by_ids.data[0].embedding, expected[2])
    norms = [torch.tensor(d.embedding).norm().item() for d in got.data]
    assert norms == pytest.approx([1.0] * len(texts), abs=1e-4)


def test_score_and_rerank_order_as_cosine_similarity(server, model, llm) -> None:
    vectors = [torch.tensor(v) for v in llm.embed([QUERY, *DOCS], use_tqdm=False)]
    cosines = [F.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]]
    order = sorted(range(len(DOCS)), key=lambda k: -cosines[k])
    assert order[0] == 3 and cosines[3] == pytest.approx(1.0, abs=1e-5)  # the query itself

    score = httpx.post(server.base_url + "/v1/score", timeout=120,
                       json={"model": model, "text_1": QUERY, "text_2": DOCS})
    assert score.status_code == 200, score.text
    body = score.json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert [d["score"] for d in body["data"]] == pytest.approx(cosines, abs=1e-3)
    pairwise = httpx.post(server.base_url + "/v1/score", timeout=120,
                          json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(cosines[:2], abs=1e-3)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        rerank = httpx.post(server.base_url + path, timeout=120,
                            json={"model": model, "query": QUERY, "documents": DOCS, "top_n": 3})
        assert rerank.status_code == 200, rerank.text
        results = rerank.json()["results"]
        assert [r["index"] for r in results] == order[:3]
        assert [r["document"]["text"] for r in results] == [DOCS[k] for k in order[:3]]
        assert [r["relevance_score"] for r in results] == pytest.approx(
            [cosines[k] for k in order[:3]], abs=1e-3)
    bare = httpx.post(server.base_url + "/v1/rerank", timeout=120,
                      json={"query": QUERY, "documents": DOCS, "return_documents": False})
    assert [r["index"] for r in bare.json()["results"]] == order
    assert all("document" not in r for r in bare.json()["results"])


BAD = [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": [""]}, "input"),
    ("/v1/embeddings", {"input": [10**9]}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input"),
    ("/v1/embeddings", {"input": list(range(3, 3 + 600))}, "input"),  # > max_model_len 512
    ("/v1/embeddings", {"input": "hi", "dimensions": 32}, None),  # not a Matryoshka model
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "unknown_field": 1}, "unknown_field"),
    ("/v1/embeddings", {"input": ["hi"] * 10_000}, "input"),
    ("/v1/embeddings", {"input": {"text": "hi"}}, "input"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": 5, "documents": ["b"]}, "query"),
]


def test_bad_inputs_are_400s_in_openai_shape_and_stall_nothing(server, model) -> None:
    tokens: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=120, json={
                "prompt": "Count to twenty:", "max_tokens": 48, "ignore_eos": True,
                "stream": True, "temperature": 0.0}) as resp:
            tokens.extend(line for line in resp.iter_lines() if line.startswith("data: {"))

    runner = threading.Thread(target=stream)
    runner.start()
    for path, body, param in BAD:
        resp = httpx.post(server.base_url + path, json=body, timeout=60)
        assert resp.status_code == 400, (path, body, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (path, body)
        if param is not None:
            assert error["param"] == param or param in error["message"], (path, body, error)
    unknown = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi", "model": "x"},
                         timeout=60)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    runner.join(120)
    assert not runner.is_alive() and len(tokens) == 48
    ok = httpx.post(server.base_url + "/v1/embeddings", json={"input": "still here"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 576
    assert "dimensions" in httpx.post(server.base_url + "/v1/embeddings", timeout=60, json={
        "input": "hi", "dimensions": 32}).json()["error"]["message"]
