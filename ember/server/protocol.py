"""The OpenAI request bodies the server accepts, as pydantic models.

Strict types (a string is not a number, a float is not an int), no NaN or infinities, and no unknown field: a
body that breaks any of these is answered 400 with the field named. OpenAI fields ember does not implement are
declared with the type ``None`` so that they are refused by name ("... is not supported"), while a client that
sends them as ``null`` still works. Ranges are checked where ember checks them for every API: ``SamplingParams``
and the input processor.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI / vLLM fields with no implementation in ember; only null is accepted for them
UNSUPPORTED = frozenset({
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "logit_bias",
    "modalities", "audio", "service_tier", "store", "metadata", "reasoning_effort",
    "web_search_options", "suffix", "best_of",
})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema under "schema" (strict is accepted: every output follows
    the schema whatever it says)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """The fields chat and completions share (OpenAI's, then vLLM's extra sampling fields)."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; not used by ember
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured output: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs
    # (StructuredOutputsParams' fields); at most one of them
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    # declared only to be refused by name when not null
    logit_bias: None = None
    service_tier: None = None
    store: None = None
    metadata: None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Prediction(_Body):
    """OpenAI's predicted output: text the reply is expected to repeat; it drafts tokens for speculative decoding
    (docs/speculative.md), and usage reports how many of them were kept."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length, as OpenAI does
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: None = None
    tool_choice: None = None
    functions: None = None
    function_call: None = None
    parallel_tool_calls: None = None
    modalities: None = None
    audio: None = None
    prediction: Prediction | None = None
    reasoning_effort: None = None
    web_search_options: None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the chosen token plus this many top ones
    echo: bool = False  # the prompt comes back before the completion
    suffix: None = None
    best_of: None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
