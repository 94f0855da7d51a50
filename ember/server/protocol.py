"""The OpenAI request bodies the server accepts, as pydantic models.

Strict types (a string is not a number, a float is not an int), no NaN or infinities, and no unknown field: a
body that breaks any of these is answered 400 with the field named. OpenAI fields ember does not implement are
declared with the type ``None`` so that they are refused by name ("... is not supported"), while a client that
sends them as ``null`` still works. Ranges are checked where ember checks them for every API: ``SamplingParams``
and the input processor. Every list and mapping has a count limit and every free-form JSON value a nesting
limit (``bounds.py``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember.sampling_params import MAX_LOGPROBS
from ember.server import bounds as B
from ember.server.bounds import at_most, nested_at_most, prompts_at_most

# OpenAI / vLLM fields with no implementation in ember; only null is accepted for them
UNSUPPORTED = frozenset({
    "functions", "function_call", "logit_bias",
    "modalities", "audio", "service_tier", "store", "metadata", "reasoning_effort",
    "web_search_options", "suffix", "best_of",
    # the Responses API's (responses_protocol.py)
    "reasoning", "prompt", "conversation", "prompt_cache_key", "safety_identifier", "max_tool_calls",
    "top_logprobs",
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
    schema_: Annotated[dict | None, nested_at_most()] = Field(default=None, alias="schema")
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
    stop: Annotated[str | list[str] | None, at_most(B.MAX_STOP)] = None
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
    stop_token_ids: Annotated[list[int] | None, at_most(B.MAX_TOKEN_IDS)] = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False  # n beams (beam_width = n, as vLLM reads it), one final answer; decoding.md
    length_penalty: float = 1.0  # beam scores: summed logprobs / generated length ** length_penalty
    # structured output: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs
    # (StructuredOutputsParams' fields); at most one of them
    response_format: ResponseFormat | None = None
    guided_json: Annotated[str | dict | None, nested_at_most(text=True)] = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str] | None, at_most(B.MAX_CHOICES)] = None
    guided_grammar: str | None = None
    structured_outputs: Annotated[dict | None, nested_at_most(keys=B.MAX_KEYS, text_keys=("json",))] = None
    # declared only to be refused by name when not null
    logit_bias: None = None
    service_tier: None = None
    store: None = None
    metadata: None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str  # a data: URI; a file or http(s) URL only where the server was started allowing it
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the resolution


class ImageURLPart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """A message of the conversation: an assistant's may hold tool calls instead of content, a tool message
    answers one of them by its id."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart | ImageURLPart] | None, at_most(B.MAX_CONTENT_PARTS)] = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall] | None, at_most(B.MAX_TOOL_CALLS)] = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _parts(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required in a {self.role} message (only an assistant message with "
                             "tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed in assistant messages, not in a {self.role} message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required in a tool message" if self.role == "tool" else
                             f"tool_call_id is only allowed in tool messages, not in a {self.role} message")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImageURLPart) for p in self.content)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: Annotated[dict | None, nested_at_most()] = None  # a JSON schema (None: no parameters)
    strict: bool | None = None  # accepted: with tool_choice required / a named function every call follows it


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class Prediction(_Body):
    """OpenAI's predicted output: text the reply is expected to repeat; it drafts tokens for speculative decoding
    (docs/speculative.md), and usage reports how many of them were kept."""

    type: Literal["content"]
    content: Annotated[str | list[TextPart], at_most(B.MAX_CONTENT_PARTS)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], at_most(B.MAX_MESSAGES)] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length, as OpenAI does
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)] = None  # refused by its own name
    tools: Annotated[list[Tool] | None, at_most(B.MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: None = None  # the deprecated forms of tools and tool_choice
    function_call: None = None
    modalities: None = None
    audio: None = None
    prediction: Prediction | None = None
    # vLLM's: extra variables for the chat template (enable_thinking, ...)
    chat_template_kwargs: Annotated[dict | None, nested_at_most(keys=B.MAX_KEYS)] = None
    thinking_token_budget: int | None = None  # vLLM's: tokens a <think> block may take before </think> is forced
    reasoning_effort: None = None
    web_search_options: None = None


class CompletionRequest(_Sampling):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], prompts_at_most(B.MAX_PROMPTS)]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the chosen token plus this many top ones
    echo: bool = False  # the prompt comes back before the completion
    suffix: None = None
    best_of: None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, at_most(B.MAX_MESSAGES)] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[int], at_most(B.MAX_TOKEN_IDS)]
