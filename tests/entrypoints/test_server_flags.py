"""`conveyor serve`'s flags, checked before any model loads: its scheduling defaults (chunked,
small steps; the offline commands keep prefill_first), where API keys come from, the flag
combinations refused with a message, a wrong --model refused before the server listens, and the
bearer check itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conveyor.engine.args import from_cli_args
from conveyor.entrypoints.cli import build_parser, main
from conveyor.entrypoints.openai.security import APIKeyMiddleware, ServerSecurity, load_api_keys
from conveyor.model.loader import default_model_path


@pytest.mark.parametrize(("command", "flags", "expected"), [
    ("serve", [], ("chunked", 64 + 64, 64)),
    ("serve", ["--max-num-seqs", "200"], ("chunked", 200 + 64, 64)),
    ("serve", ["--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "0"],
     ("chunked", 512, 0)),
    ("serve", ["--policy", "prefill_first"], ("prefill_first", 4096, 0)),
    ("generate", ["hi"], ("prefill_first", 4096, 0)),
    ("chat", [], ("prefill_first", 4096, 0)),
])
def test_scheduling_defaults(command, flags, expected) -> None:
    args = from_cli_args(build_parser().parse_args([command, *flags]))
    assert (str(args.policy), args.max_num_batched_tokens,
            args.long_prefill_token_threshold) == expected


def test_keys_from_flags_file_and_environment(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\n  sk-file-1  \nsk-flag\nsk-file-2\n")
    keys = load_api_keys(["sk-flag"], key_file, environ={"CONVEYOR_API_KEY": "sk-env"})
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env")
    assert load_api_keys([], None, environ={}) == ()
    assert "sk-flag" not in repr(ServerSecurity(api_keys=keys))


@pytest.mark.parametrize(("content", "fragment"), [(None, "cannot read"),
                                                   ("# only a comment\n\n", "holds no key")])
def test_a_key_file_without_keys_is_refused(tmp_path, content, fragment) -> None:
    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        load_api_keys([], key_file, environ={})


@pytest.mark.parametrize(("flags", "message"), [
    (["--api-key", " "], "--api-key must not be empty"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file"),
    (["--ssl-keyfile", "/tmp/key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/nonexistent/k", "--ssl-certfile", "/nonexistent/c"], "no such file"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--max-tools", "0"], "--max-tools must be >= 1"),
    (["--allow-runtime-lora"], "--allow-runtime-lora needs --enable-lora"),
    (["--enable-lora", "--lora-root", "/tmp"], "--lora-root needs --allow-runtime-lora"),
    (["--enable-lora", "--allow-runtime-lora", "--lora-root", "/nonexistent/adapters"],
     "--lora-root /nonexistent/adapters: not a directory"),
])
def test_bad_flags_stop_before_the_model_loads(flags, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert message in str(info.value.code)


def test_a_wrong_model_stops_before_the_server_listens(tmp_path) -> None:
    junk, other, empty = tmp_path / "junk.gguf", tmp_path / "model.bin", tmp_path / "empty"
    cut = tmp_path / "cut.gguf"  # a good header, the tensors cut short
    data = Path(default_model_path()).read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    junk.write_bytes(b"not a gguf file")
    other.write_bytes(b"weights")
    empty.mkdir()
    for model, message in ((tmp_path / "missing.gguf", "not found"),
                           (junk, "is not a GGUF file"), (other, "neither a .gguf file"),
                           (empty, "missing config.json"),
                           (cut, f"{cut} is not a readable GGUF file")):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", str(model), "--port", "1"])
        assert message in str(info.value.code), model


@pytest.mark.parametrize(("authorization", "status"), [
    (None, 401), (b"Bearer sk-a", 200), (b"bearer   sk-a ", 200), ("Bearer clé-ü".encode(), 200),
    (b"Bearer sk-b", 401), (b"Bearer sk-a-longer", 401), (b"Token sk-a", 401), (b"Bearer ", 401),
])
def test_bearer_check(authorization, status) -> None:
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(path: str) -> int:
        sent = []

        async def send(message) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b""}

        headers = [] if authorization is None else [(b"authorization", authorization)]
        await APIKeyMiddleware(app, ["sk-a", "clé-ü"], metrics_require_key=False)(
            {"type": "http", "path": path, "headers": headers}, receive, send)
        return sent[0]["status"]

    assert asyncio.run(call("/v1/models")) == status
    assert asyncio.run(call("/health")) == 200
    assert asyncio.run(call("/metrics")) == 200
