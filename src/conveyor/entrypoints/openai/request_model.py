"""The one base of every request body the server parses (and of the objects nested in them):
strict JSON types, no coercion (``"max_tokens": "5"`` is not an integer), and no fields beyond
the model's, as OpenAI's and Anthropic's own servers answer an unrecognized argument: a field
silently ignored (a misspelt ``max_token``, a ``guided_json`` this server does not implement)
would be a wrong answer, not an error. Fields an upstream API defines that change nothing here
(``metadata``, ``service_tier``, ...) are declared by each model, so that SDK clients work."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
