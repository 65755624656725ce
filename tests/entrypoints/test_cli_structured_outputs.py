"""`conveyor generate --json-schema FILE`, `--regex`, `--choice` and `--grammar FILE` as real
subprocesses on the embedded model; a bad constraint is a clean error (exit 2)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_cli_engine import SMALL, conveyor

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"]}


def outputs(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return [o["text"] for item in json.loads(proc.stdout) for o in item["outputs"]]


@pytest.mark.slow
def test_json_schema_regex_and_choice_from_the_cli(tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    (text,) = outputs(conveyor("generate", "Describe the weather in a city.", "--chat", "--json",
                               "--json-schema", str(schema), "--max-tokens", "60",
                               "--temperature", "0", *SMALL))
    jsonschema.validate(json.loads(text), SCHEMA)
    texts = outputs(conveyor("generate", "Call me at", "Our office number:", "--json",
                             "--regex", r"[0-9]{3}-[0-9]{4}", "--max-tokens", "20", *SMALL))
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) for t in texts), texts
    (text,) = outputs(conveyor("generate", "Is water wet?", "--chat", "--json", "--choice", "yes",
                               "no", "--temperature", "0", *SMALL))
    assert text in ("yes", "no")


def test_bad_constraints_are_clean_errors(tmp_path) -> None:
    grammar = tmp_path / "bad.ebnf"
    grammar.write_text("root ::= (")
    proc = conveyor("generate", "hi", "--grammar", str(grammar), *SMALL)
    assert proc.returncode == 2
    assert "structured_outputs.grammar cannot be compiled: EBNF parser error" in proc.stderr
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "objekt"}')
    proc = conveyor("generate", "hi", "--json-schema", str(schema), *SMALL)
    assert proc.returncode == 2 and "is not a valid JSON schema" in proc.stderr
    proc = conveyor("generate", "hi", "--regex", "a", "--choice", "a", *SMALL)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
