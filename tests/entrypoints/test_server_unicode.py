"""Every POST route of the server's OpenAPI document, walked string by string: a valid body is
served, and the same body with any one of its strings (or an object key) turned into a lone
UTF-16 surrogate is a 400 in the route's own error shape (OpenAI's, Anthropic's on /v1/messages,
Ollama's on /api/) naming the field, whole and streamed (SSE, or Ollama's NDJSON); no
connection is dropped and nothing reaches the tokenizer. The multipart upload's form fields and
a batch's input lines are checked the same way; ``--invalid-unicode replace`` serves such text
instead, with U+FFFD in place of each surrogate."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

SURROGATES = ("\ud800", "a\udfffb")
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                         "parameters": {"type": "object", "properties": {
                                             "word": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup",
                                                        "arguments": '{"word": "x"}'}}
OLLAMA_OPTIONS = {"num_predict": 2, "stop": ["zz"], "temperature": 0}
# A valid body per POST route, with as many string fields as the route reads ("{model}": the
# served model's name, "{file_id}": an uploaded batch input file); the routes that stream
# (Ollama's by default: their bodies here ask for a whole answer, and the walk streams them).
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "stop": ["zz"], "user": "u"},
    "/v1/chat/completions": {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "content": "a word", "tool_call_id": "call_1"}],
        "max_tokens": 2, "tools": [TOOL], "tool_choice": "none", "stop": "zz", "user": "u"},
    "/v1/messages": {
        "model": "{model}", "max_tokens": 2, "system": "Be brief.", "stop_sequences": ["zz"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": "Hello"},
                     {"role": "user", "content": "Bye"}],
        "metadata": {"user_id": "u"}},
    "/v1/responses": {"instructions": "Be brief.", "max_output_tokens": 2, "user": "u",
                      "input": [{"role": "user", "content": [{"type": "input_text",
                                                               "text": "Hi"}]}],
                      "metadata": {"k": "v"}},
    "/v1/embeddings": {"input": ["Hi", "there"], "user": "u"},
    "/v1/score": {"text_1": "a cat", "text_2": ["a dog", "a car"]},
    "/v1/rerank": {"query": "a cat", "documents": ["a dog", "a car"]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/adapters/a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
    "/v1/batches": {"input_file_id": "{file_id}", "endpoint": "/v1/chat/completions",
                    "completion_window": "24h", "metadata": {"k": "v"}},
    "/api/chat": {
        "model": "{model}", "stream": False, "keep_alive": "5m", "options": OLLAMA_OPTIONS,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "lookup", "arguments": {"word": "x"}}}]},
                     {"role": "tool", "content": "a word", "tool_name": "lookup"}],
        "tools": [TOOL]},
    "/api/generate": {"model": "{model}", "stream": False, "prompt": "Hi",
                      "system": "Be brief.", "keep_alive": "5m", "options": OLLAMA_OPTIONS},
    "/api/embed": {"model": "{model}", "input": ["Hi", "there"], "keep_alive": "5m"},
    "/api/embeddings": {"model": "{model}", "prompt": "Hi", "keep_alive": "5m"},
    "/api/show": {"model": "{model}"},
}
STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
             "/api/chat", "/api/generate"}
RUNTIME_LORA = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # off here: 403 first
# POST routes without a JSON body to walk, each with its own test below: the multipart upload
# (its form fields, and its lines when a batch reads them) and a batch's cancel (a path id).
NOT_JSON = {"/v1/files", "/v1/batches/{batch_id}/cancel"}
BATCH_LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}


def _strings(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every string value in ``value``."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, (*path, i))


def _with(body: dict[str, Any], path: tuple[Any, ...], text: str) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = text
    return out


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \udXXX: valid JSON, as a client would send it
    return httpx.post(base + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"content-type": "application/json"})


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]


def _upload(base: str, data: bytes, purpose: str = "batch") -> httpx.Response:
    return httpx.post(base + "/v1/files", files={"file": ("in.jsonl", data)},
                      data={"purpose": purpose}, timeout=30)


def _jsonl(*lines: dict[str, Any]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _bodies(base: str) -> dict[str, dict[str, Any]]:
    model = _model(base)
    upload = _upload(base, _jsonl(BATCH_LINE))
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    return {path: json.loads(json.dumps(body).replace("{model}", model)
                             .replace("{file_id}", file_id))
            for path, body in BODIES.items()}


def _batch(base: str, batch_id: str) -> dict[str, Any]:
    """The batch once it has ended."""
    for _ in range(600):
        batch = httpx.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()
        if batch["status"] in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(batch)


@pytest.fixture(scope="module")
def walk_server(start_server, tmp_path_factory):
    """A server whose batch jobs live in a folder of the test's."""
    return start_server(["--batch-dir", str(tmp_path_factory.mktemp("batches"))])


def _check_refused(path: str, resp: httpx.Response, where: tuple[Any, ...]) -> None:
    assert resp.status_code == 400, (path, where, resp.text[:300])
    dotted = ".".join(str(p) for p in where)
    if path.startswith("/api/"):  # Ollama's shape: {"error": message}
        err = resp.json()
        assert set(err) == {"error"} and f"'{dotted}'" in err["error"], err
        assert "\\ud" in err["error"], err
        return
    if path == "/v1/messages":
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert f"'{dotted}'" in err["error"]["message"], err
        return
    err = resp.json()["error"]
    assert err["code"] == "invalid_unicode" and err["param"] == str(where[0]), (where, err)
    assert f"'{dotted}'" in err["message"] and "\\ud" in err["message"], err


def test_every_route_names_the_field_of_a_lone_surrogate(walk_server) -> None:
    server = walk_server
    base = server.base_url
    doc = httpx.get(base + "/openapi.json", timeout=30).json()
    posts = {path for path, ops in doc["paths"].items() if "post" in ops}
    assert posts == set(BODIES) | NOT_JSON, "a POST route without a body to walk here"
    walked = 0
    for path, body in _bodies(base).items():
        if path in RUNTIME_LORA:
            resp = _post(base, path, _with(body, ("lora_name",), SURROGATES[0]))
            assert resp.status_code == 403, resp.text  # checked at tests/.../test_server_lora
            continue
        ok = _post(base, path, body)
        assert ok.status_code == 200, (path, ok.text[:300])
        for where in _strings(body):
            for k, text in enumerate(SURROGATES):
                sent = _with(body, where, text)
                if k == 1 and path in STREAMING:
                    sent["stream"] = True
                _check_refused(path, _post(base, path, sent), where)
                walked += 1
        # a key: {"\udc00": ...} inside the body
        resp = _post(base, path, {**body, "\udc00": 1})
        assert resp.status_code == 400 and "field name" in resp.text, resp.text
    assert walked >= 100
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "unhandled error" not in log and "Exception in ASGI application" not in log


def test_invalid_unicode_replace_serves_the_text(start_server, tmp_path_factory) -> None:
    s = start_server(["--invalid-unicode", "replace",
                      "--batch-dir", str(tmp_path_factory.mktemp("batches"))])
    resp = _post(s.base_url, "/v1/completions",
                 {"prompt": "Say \ud800 twice", "max_tokens": 2, "echo": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("Say \ufffd twice")
    chat = _post(s.base_url, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2,
                  "stream": True})
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]"), chat.text
    model = _model(s.base_url)
    ollama = _post(s.base_url, "/api/generate", {"model": model, "prompt": "Say \ud800",
                                                 "options": {"num_predict": 2}})
    last = json.loads(ollama.text.splitlines()[-1])  # streamed NDJSON, as Ollama's default
    assert ollama.status_code == 200 and last["done"] is True, ollama.text
    upload = _upload(s.base_url, _jsonl({**BATCH_LINE, "custom_id": "a\udfff"}))
    created = httpx.post(s.base_url + "/v1/batches", timeout=30, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions"})
    batch = _batch(s.base_url, created.json()["id"])
    assert batch["status"] == "completed", batch
    output = httpx.get(f"{s.base_url}/v1/files/{batch['output_file_id']}/content", timeout=30)
    assert json.loads(output.text)["custom_id"] == "a\ufffd", output.text


def _form(*parts: tuple[bytes, bytes]) -> bytes:
    """A multipart body of (Content-Disposition parameters, content) parts, boundary "b"."""
    return b"".join(b"--b\r\nContent-Disposition: form-data; " + params + b"\r\n\r\n"
                    + content + b"\r\n" for params, content in parts) + b"--b--\r\n"


def test_the_upload_and_a_batch_s_lines_are_checked(walk_server) -> None:
    base = walk_server.base_url
    # Form text is decoded by the charset the Content-Type names; "unicode_escape" spells a
    # lone surrogate as JSON does.
    for purpose, filename, where in ((b"batch\\ud800", b"in.jsonl", "'purpose'"),
                                     (b"batch", b"in\\udfff.jsonl", "'file.filename'")):
        form = _form((b'name="file"; filename="' + filename + b'"', _jsonl(BATCH_LINE)),
                     (b'name="purpose"', purpose))
        resp = httpx.post(base + "/v1/files", content=form, timeout=30, headers={
            "content-type": "multipart/form-data; boundary=b; charset=unicode_escape"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "invalid_unicode" and where in err["message"], err
    resp = httpx.post(base + "/v1/files", content=_form(
        (b'name="file"; filename="in.jsonl"', _jsonl(BATCH_LINE)), (b'name="purpose"', b"batch")),
        headers={"content-type": "multipart/form-data; boundary=b; charset=unicode_escape"})
    assert resp.status_code == 200, resp.text  # the same form without one is taken
    # a line with a lone surrogate (in its body, or in its custom id) fails the batch naming
    # the line and the field; the same file without one runs
    for line, field in (({**BATCH_LINE, "body": {**BATCH_LINE["body"], "messages": [
            {"role": "user", "content": "Hi \ud800"}]}}, "'body.messages.0.content'"),
                        ({**BATCH_LINE, "custom_id": "\udfff"}, "'custom_id'")):
        upload = _upload(base, _jsonl({**BATCH_LINE, "custom_id": "ok"}, line))
        assert upload.status_code == 200, upload.text
        created = httpx.post(base + "/v1/batches", timeout=30, json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch = _batch(base, created.json()["id"])
        assert batch["status"] == "failed", batch
        (error,) = batch["errors"]["data"]
        assert error["line"] == 2 and error["code"] == "invalid_unicode", error
        assert field in error["message"], error
    upload = _upload(base, _jsonl(BATCH_LINE, {**BATCH_LINE, "custom_id": "b"}))
    created = httpx.post(base + "/v1/batches", timeout=30, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions"})
    batch = _batch(base, created.json()["id"])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2, batch


def test_a_cancel_of_no_batch_is_a_404(walk_server) -> None:
    """The cancel route reads only its path: an unknown id, or one no batch can have, is a
    404 (sent as JSON, as every POST to /v1/ must be, the body empty as clients send it)."""
    for batch_id in ("batch_0", "%ED%A0%80", "%5Cud800"):
        resp = httpx.post(f"{walk_server.base_url}/v1/batches/{batch_id}/cancel", timeout=30,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "batch_not_found", resp.text
