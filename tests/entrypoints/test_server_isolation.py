"""No request stops the others under `conveyor serve`'s default scheduling (chunked prefill,
small steps): while a long stream runs, a 4,000-token prompt, plain or with
``prompt_logprobs``, an embeddings request of 2,000 inputs, a rerank of 3,000 documents and an
abandoned 100,000-entry ``enum`` compile each leave the stream's largest gap between tokens
under 2 s; the ``prompt_logprobs`` request without growing the server's memory by prompt x
vocabulary, the compile giving back its process's memory as soon as its client leaves.

The server gets no scheduling flag: only a context and a KV cache that hold 4,000 tokens and
prompt limits that let 3,000 texts in one request."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT_TOKENS = 4000
MAX_GAP_S = 2.0
FLAGS = ["--max-model-len", "4200", "--num-gpu-blocks", "300",
         "--max-prompts-per-request", "4096", "--max-sequences-in-flight", "4096",
         "--structured-outputs-compile-timeout", "120"]
NUM_EMBEDDING_INPUTS = 2000
NUM_RERANK_DOCUMENTS = 3000


@pytest.fixture(scope="module")
def chunked(start_server):
    """A server on the default scheduling flags (they chunk prefills)."""
    return start_server(FLAGS)


class Stream:
    """A long greedy stream in a thread; ``times`` holds each chunk's arrival."""

    def __init__(self, base_url: str, max_tokens: int = 2000) -> None:
        self.times: list[float] = []
        body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._response: httpx.Response | None = None
        self._thread.start()
        while len(self.times) < 5:
            time.sleep(0.05)

    def _run(self, base_url: str, body: dict) -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as resp:
            self._response = resp
            try:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.monotonic())
            except httpx.HTTPError:  # close() cut it
                pass

    def max_gap(self, start: float, end: float) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)
                if start <= b <= end]
        assert len(gaps) >= 5, "the stream did not run meanwhile"
        print(f"largest gap {max(gaps):.3f} s over {len(gaps)} tokens")  # the figure, with -s
        return max(gaps)

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
        self._thread.join(30)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _compile_workers(server_pid: int) -> dict[int, float]:
    """The server's grammar-compile processes and their memory (MiB)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if ppid == server_pid and b"compile_worker" in cmdline:
                out[int(entry)] = _rss_mib(int(entry))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return out


def _long_prompt() -> list[int]:
    return [(i * 7919) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def test_a_long_plain_prompt_leaves_streams_moving(chunked) -> None:
    stream = Stream(chunked.base_url)
    try:
        start = time.monotonic()
        resp = httpx.post(chunked.base_url + "/v1/completions", timeout=600,
                          json={"prompt": _long_prompt(), "max_tokens": 2})
        end = time.monotonic()
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS
        assert stream.max_gap(start, end) < MAX_GAP_S
    finally:
        stream.close()


def test_an_embeddings_request_of_2000_inputs_leaves_streams_moving(chunked) -> None:
    stream = Stream(chunked.base_url)
    try:
        texts = [f"note {i}" for i in range(NUM_EMBEDDING_INPUTS)]
        start = time.monotonic()
        resp = httpx.post(chunked.base_url + "/v1/embeddings", timeout=600,
                          json={"input": texts})
        end = time.monotonic()
        assert resp.status_code == 200, resp.text[:300]
        data = resp.json()["data"]
        assert [d["index"] for d in data] == list(range(NUM_EMBEDDING_INPUTS))
        assert len({tuple(d["embedding"][:8]) for d in data}) > NUM_EMBEDDING_INPUTS // 2
        assert stream.max_gap(start, end) < MAX_GAP_S
    finally:
        stream.close()


def test_a_rerank_of_3000_documents_leaves_streams_moving(chunked) -> None:
    stream = Stream(chunked.base_url)
    try:
        docs = [f"doc {i}" for i in range(NUM_RERANK_DOCUMENTS)]
        start = time.monotonic()
        resp = httpx.post(chunked.base_url + "/v1/rerank", timeout=600,
                          json={"query": "doc 7", "documents": docs})
        end = time.monotonic()
        assert resp.status_code == 200, resp.text[:300]
        results = resp.json()["results"]
        assert sorted(r["index"] for r in results) == list(range(NUM_RERANK_DOCUMENTS))
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        assert results[0]["index"] == 7  # the query's own text scores highest
        assert stream.max_gap(start, end) < MAX_GAP_S
    finally:
        stream.close()


def test_a_long_prompt_logprobs_request_is_chunked_and_bounded(chunked) -> None:
    base, pid = chunked.base_url, chunked.proc.pid
    stream = Stream(base)
    try:
        rss_before = _rss_mib(pid)
        ids = _long_prompt()
        start = time.monotonic()
        resp = httpx.post(base + "/v1/completions", timeout=600,
                          json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        end = time.monotonic()
        assert resp.status_code == 200, resp.text[:300]
        scored = resp.json()["choices"][0]["prompt_logprobs"]
        assert len(scored) == PROMPT_TOKENS and scored[0] is None
        assert all(str(ids[i]) in scored[i] and len(scored[i]) <= 3 for i in range(1, len(ids)))
        assert stream.max_gap(start, end) < MAX_GAP_S
        # a step holds 64 rows of logits; the whole prompt's would be 4000 x 49152 floats (750 MiB)
        assert _rss_mib(pid) < rss_before + 300, (rss_before, _rss_mib(pid))
    finally:
        stream.close()


def test_an_abandoned_huge_enum_compile_stops_and_frees_its_memory(chunked) -> None:
    base, pid = chunked.base_url, chunked.proc.pid
    warm = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": "Pick:", "max_tokens": 3, "structured_outputs": {"regex": "[a-c]{3}"}})
    assert warm.status_code == 200, warm.text  # the compile processes are up
    idle = _compile_workers(pid)
    assert idle, "no compile process"
    stream = Stream(base)
    try:
        schema = {"type": "string", "enum": [f"value-{i}-x" for i in range(100_000)]}
        body = json.dumps({"prompt": "Pick one:", "max_tokens": 5, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}).encode()
        start = time.monotonic()
        client = socket.create_connection(("127.0.0.1", chunked.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        baseline = max(idle.values())
        deadline = time.monotonic() + 60
        while max(_compile_workers(pid).values(), default=0) < baseline + 100:
            assert time.monotonic() < deadline, "the compile never got under way"
            time.sleep(0.1)
        client.close()  # the client leaves while its constraint compiles
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            workers = _compile_workers(pid)
            if workers and max(workers.values()) < baseline + 100:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the abandoned compile still holds memory: {workers}, idle "
                                 f"{idle}")
        t0 = time.monotonic()
        small = httpx.post(base + "/v1/completions", timeout=120, json={
            "prompt": "Code:", "max_tokens": 4, "structured_outputs": {"regex": "[0-9]{4}"}})
        assert small.status_code == 200, small.text
        assert time.monotonic() - t0 < 10  # no abandoned compile is in its way
        end = time.monotonic()
        assert stream.max_gap(start, end) < MAX_GAP_S
    finally:
        stream.close()
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200
