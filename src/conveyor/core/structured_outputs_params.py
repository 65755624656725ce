"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names).

Exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings) or ``grammar`` (EBNF, xgrammar's dialect of GBNF) is set.
``reasoning_end``: token ids that end a reasoning model's thinking (``</think>``); when given,
the constraint applies to the output after their first occurrence, the reasoning is free.
``reasoning_start`` (``<think>``), with it: only a reply that opens with these thinks; any other
is constrained from its first token.
Construction checks what pure Python can: the schema against its JSON Schema meta-schema
(``jsonschema``), the regex with ``re``, the shape of the choices and of the grammar. The full
compile against the tokenizer happens off the step loop (``conveyor.structured_outputs``);
what only the compiler can reject finishes that request alone, with the compiler's message.
"""

from __future__ import annotations

import json as json_lib
import re
from dataclasses import dataclass
from typing import Any

from conveyor.core.json_depth import json_depth_exceeds

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The deepest JSON schema accepted (objects and lists, counted as a parsed body's are): the
# validator and the compiler walk a schema recursively.
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    reasoning_start: tuple[int, ...] = ()  # these two are not part of the grammar, nor of
    reasoning_end: tuple[int, ...] = ()  # its cache key

    def __post_init__(self) -> None:
        if self.choice is not None and isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("reasoning_start", "reasoning_end"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not all(isinstance(t, int) and t >= 0 for t in getattr(self, name)):
                raise ValueError(f"structured_outputs.{name} must be token ids")
        if self.reasoning_start and not self.reasoning_end:
            raise ValueError("structured_outputs.reasoning_start needs reasoning_end")
        if isinstance(self.json, str):
            object.__setattr__(self, "json", _parse_schema(self.json))
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, json_object, "
                             f"regex, choice, grammar; got {set_kinds or 'none'}")
        self._check()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """The compile cache's key: the kind and a canonical text of the constraint."""
        kind = self.kind
        if kind == "json":
            return kind, json_lib.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json_lib.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    def _check(self) -> None:
        if self.json is not None:
            if not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                 f"{type(self.json).__name__}")
            if json_depth_exceeds(self.json, MAX_SCHEMA_DEPTH):
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} "
                                 "levels")
            from jsonschema import SchemaError, validators

            try:
                validators.validator_for(self.json).check_schema(self.json)
            except RecursionError as e:
                raise ValueError("structured_outputs.json nests too deeply to check") from e
            except SchemaError as e:
                raise ValueError(f"structured_outputs.json is not a valid JSON schema: "
                                 f"{e.message}") from e
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("structured_outputs.regex must be a non-empty string")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"structured_outputs.regex is not a valid regex: {e}") from e
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF string")


def _parse_schema(text: str) -> Any:
    try:
        return json_lib.loads(text)
    except json_lib.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
    except RecursionError as e:
        raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} "
                         "levels") from e
