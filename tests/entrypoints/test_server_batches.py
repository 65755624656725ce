"""OpenAI's Files and Batch APIs against a real `conveyor serve`, through the official ``openai``
client: a 200-request batch whose every output equals the same request sent alone; a server
stopped mid-batch and started again on the same folder finishes it with nothing lost or run
twice; cancel, list, a bad input file and unknown ids; ``conveyor run-batch`` offline."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from conveyor.core.config import QueueOrder
from conveyor.entrypoints.cli import main
from conveyor.entrypoints.openai.batch.lines import BATCH_PRIORITY, batch_body

POLL_S = 0.2


MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default model's name, as the server serves it


def _line(i: int, max_tokens: int = 6, **extra) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL,
                     "messages": [{"role": "user", "content": f"Say the number {i}."}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def _upload(client: openai.OpenAI, lines: list[dict], tmp_path) -> str:
    path = tmp_path / f"in-{time.monotonic_ns()}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(POLL_S)
    raise AssertionError(f"batch {batch_id} did not get there in {timeout}s: {batch}")


def _results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]
    return {row["custom_id"]: row for row in rows}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def batch_server(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    return start_server(["--batch-dir", str(folder)]), folder


@pytest.mark.slow
def test_a_200_request_batch_equals_each_request_sent_alone(batch_server, tmp_path) -> None:
    server, _ = batch_server
    client = _client(server)
    assert client.models.list().data[0].id == MODEL
    lines = [_line(i) for i in range(200)]
    file_id = _upload(client, lines, tmp_path)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "200"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "200"}
    batch = _wait(client, batch.id, lambda b: b.status == "completed")
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (200, 200, 0)
    assert batch.error_file_id is None and batch.completed_at >= batch.created_at
    results = _results(client, batch.output_file_id)
    assert sorted(results) == sorted(line["custom_id"] for line in lines)
    for line in lines:  # each request alone, one at a time
        alone = client.chat.completions.create(**line["body"])
        got = results[line["custom_id"]]["response"]
        assert got["status_code"] == 200
        choice = got["body"]["choices"][0]
        assert choice["message"]["content"] == alone.choices[0].message.content
        assert choice["finish_reason"] == alone.choices[0].finish_reason
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    assert file_id in [f.id for f in client.files.list()]


def test_failed_requests_go_to_the_error_file(batch_server, tmp_path) -> None:
    client = _client(batch_server[0])
    lines = [_line(0), _line(1, max_tokens=100000), _line(2, model="no-such-model")]
    batch = client.batches.create(input_file_id=_upload(client, lines, tmp_path),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait(client, batch.id, lambda b: b.status == "completed")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    errors = _results(client, batch.error_file_id)
    assert errors["req-1"]["response"]["status_code"] == 400
    assert "context length" in errors["req-1"]["response"]["body"]["error"]["message"]
    assert errors["req-2"]["response"]["status_code"] == 404
    assert list(_results(client, batch.output_file_id)) == ["req-0"]


@pytest.mark.parametrize(("content", "code"), [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n',
     "invalid_url"),
    (json.dumps(_line(0)).encode() + b"\n" + json.dumps(_line(0)).encode() + b"\n",
     "duplicate_custom_id"),
    (b"not json\n", "invalid_json_line"),
])
def test_a_bad_input_file_fails_the_batch(batch_server, tmp_path, content, code) -> None:
    client = _client(batch_server[0])
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = _wait(client, batch.id, lambda b: b.status == "failed")
    assert batch.errors.data[0].code == code and batch.errors.data[0].line >= 1


def test_unknown_ids_and_bad_requests(batch_server) -> None:
    client = _client(batch_server[0])
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0123")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-0123")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-0123", endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id="file-0123", endpoint="/v1/chat/completions",
                              completion_window="1h")
    resp = httpx.post(batch_server[0].base_url + "/v1/files", timeout=30,
                      files={"file": ("x.jsonl", b"{}")}, data={"purpose": "nonsense"})
    assert resp.status_code == 400 and "purpose" in resp.json()["error"]["message"]


def test_cancel_keeps_what_finished(batch_server, tmp_path) -> None:
    client = _client(batch_server[0])
    lines = [_line(i, max_tokens=64, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(input_file_id=_upload(client, lines, tmp_path),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id, lambda b: b.status == "cancelled")
    done = _results(client, batch.output_file_id)
    assert 1 <= len(done) == batch.request_counts.completed < 40
    with pytest.raises(openai.APIStatusError) as info:
        client.batches.cancel(batch.id)
    assert info.value.status_code == 409
    for _ in range(100):  # the cancelled requests were aborted: the engine empties
        metrics = batch_server[0].metrics()
        if (metrics["conveyor:num_requests_running"] == 0
                and metrics["conveyor:num_requests_waiting"] == 0):
            break
        time.sleep(0.05)
    assert metrics["conveyor:num_requests_running"] == 0
    assert metrics["conveyor:num_requests_waiting"] == 0


@pytest.mark.slow
def test_a_restart_mid_batch_loses_nothing(start_server, tmp_path) -> None:
    folder = tmp_path / "state"
    first = start_server(["--batch-dir", str(folder)])
    client = _client(first)
    lines = [_line(i, max_tokens=32, ignore_eos=True) for i in range(32)]
    batch = client.batches.create(input_file_id=_upload(client, lines, tmp_path),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
    assert first.stop() == 0
    saved = json.loads((folder / "batches" / f"{batch.id}.json").read_text())
    assert saved["status"] == "in_progress", "the batch ended before the server stopped"
    assert 2 <= saved["request_counts"]["completed"] < 32
    second = start_server(["--batch-dir", str(folder)])
    client = _client(second)
    batch = _wait(client, batch.id, lambda b: b.status == "completed")
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (32, 32, 0)
    rows = client.files.content(batch.output_file_id).text.splitlines()
    assert len(rows) == 32  # none run twice
    results = {json.loads(r)["custom_id"]: json.loads(r)["response"] for r in rows}
    for line in (lines[0], lines[-1]):  # one from before the restart, one after
        alone = httpx.post(second.base_url + "/v1/chat/completions", json=line["body"],
                           timeout=120).json()
        assert results[line["custom_id"]]["body"]["choices"][0]["message"]["content"] == \
            alone["choices"][0]["message"]["content"]


def test_batch_requests_yield_to_interactive_ones_in_a_priority_queue() -> None:
    body = {"messages": [], "priority": 3}
    assert batch_body(body, QueueOrder.FCFS) == body
    assert batch_body(body, QueueOrder.PRIORITY)["priority"] == BATCH_PRIORITY > 0


@pytest.mark.slow
def test_run_batch_offline(tmp_path, capsys) -> None:
    lines = [_line(0), {**_line(1), "url": "/v1/completions",
                        "body": {"prompt": "The capital of France is", "max_tokens": 6,
                                 "temperature": 0}},
             _line(2, max_tokens=100000)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                 "--max-model-len", "512", "--seed", "0"]) == 0
    rows = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["req-0", "req-1", "req-2"]
    assert [r["response"]["status_code"] for r in rows] == [200, 200, 400]
    assert rows[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert rows[1]["response"]["body"]["object"] == "text_completion"
    assert "2 of 3 requests succeeded" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"custom_id": "x", "url": "/v1/nope", "body": {}}\n')
    with pytest.raises(SystemExit, match="line 1"):
        main(["run-batch", "-i", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "o.jsonl")])
