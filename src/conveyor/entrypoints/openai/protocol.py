"""Request bodies of the OpenAI API that Conveyor serves, validated strictly (wrong JSON types
are rejected, not coerced), and their translation into SamplingParams.

Fields beyond OpenAI's (``top_k``, ``min_p``, ``priority``, ...) follow vLLM's names. An
unknown field is a 400, as on OpenAI's own server (``request_model``); the OpenAI fields that
change nothing here (``metadata``, ``store``, ``service_tier``, ...) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.structured_outputs_params import StructuredOutputsParams
from conveyor.entrypoints.openai.request_model import RequestModel
from conveyor.entrypoints.openai.structured import structured_outputs_params


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends logit_bias keys as strings of token ids."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.strip().isascii() and key.strip().isdigit()):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {key!r}")
        out[int(key)] = value
    return out


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestModel):
    """vLLM's ``structured_outputs`` extra field (one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1)  # upper bound: ServerLimits.max_n
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        def pick(value: object, default: object) -> object:
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_bias(self.logit_bias),
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=self._constraint(),
        )

    def _constraint(self) -> StructuredOutputsParams | None:
        return structured_outputs_params(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        echo_logprobs = self.logprobs if self.echo else None  # the prompt's tokens' logprobs
        return self._sampling_params(max_tokens, self.logprobs, echo_logprobs)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: _FunctionName


class ToolCallFunction(RequestModel):
    name: str
    arguments: str  # the call's arguments as JSON text, as OpenAI sends them


class AssistantToolCall(RequestModel):
    """One of an assistant message's earlier tool calls."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    # an earlier reply sent back as the SDKs return it: its reasoning is not part of the prompt
    refusal: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's fields that change nothing on this server, accepted so that SDK clients work
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    # the schema a 'required' or named tool_choice enforces (set by the handler, tools.py)
    _tool_constraint: StructuredOutputsParams | None = PrivateAttr(None)

    def _constraint(self) -> StructuredOutputsParams | None:
        own = structured_outputs_params(self)
        if self._tool_constraint is not None and own is not None:
            raise ValueError("tool_choice 'required' or a named function cannot be combined with "
                             "response_format or structured_outputs")
        return self._tool_constraint or own
