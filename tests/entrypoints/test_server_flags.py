"""`conveyor serve`'s security flags, checked before any model loads: where API keys come from,
and the flag combinations refused with a message."""

from __future__ import annotations

import pytest

from conveyor.entrypoints.cli import main
from conveyor.entrypoints.openai.security import ServerSecurity, load_api_keys


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
])
def test_bad_flags_stop_before_the_model_loads(flags, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert message in str(info.value.code)
