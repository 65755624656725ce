"""`conveyor bench throughput --structured json`: the same workload with every request under a
JSON schema, beside the unconstrained run.

The schema asks for a list of at least 32 records (a string, a bounded integer, an enum, a list
of strings), so no request's grammar can end before the workload's ``max_tokens``: both runs
generate exactly the same number of tokens, and their ratio is the cost of constraining.
(Length bounds on strings, ``maxLength``, make xgrammar's masks several times costlier to fill;
docs/structured_outputs.md.)
"""

from __future__ import annotations

from typing import Any

RECORD = {"type": "object", "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "status": {"enum": ["active", "idle", "gone"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "status", "tags"]}
SCHEMAS: dict[str, dict[str, Any]] = {
    "json": {"type": "array", "items": RECORD, "minItems": 32},
}


def structured_outputs(kind: str | None):  # -> StructuredOutputsParams | None
    from conveyor.core.structured_outputs_params import StructuredOutputsParams

    if kind is None:
        return None
    if kind not in SCHEMAS:
        raise ValueError(f"--structured {kind!r}: one of {', '.join(sorted(SCHEMAS))}")
    return StructuredOutputsParams(json=SCHEMAS[kind])
