"""The Responses API's request body (``POST /v1/responses``) as strict pydantic models, like ``protocol.py``: wrong
types, NaN and unknown fields are refused naming the field; OpenAI fields ember does not implement are declared
``None`` so that they are refused by name unless sent as null.

Input items are the shapes the openai client sends, including the ones it echoes back from an earlier response
(output messages with ids, statuses and annotations; function calls and their outputs).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag

from ember.server import bounds as B
from ember.server.bounds import at_most, nested_at_most
from ember.server.protocol import _Body


# OpenAI's metadata: string pairs, keys of at most 64 characters, values of at most 512
_MetadataKey = Annotated[str, StringConstraints(max_length=B.MAX_METADATA_KEY)]
_MetadataValue = Annotated[str, StringConstraints(max_length=B.MAX_METADATA_VALUE)]


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class InputImage(_Body):
    """An image of a user's message (a vision-language model): a data: URI, or a file / http(s) URL where the
    server allows them; OpenAI's uploaded files (file_id) are not kept here."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None
    file_id: None = None


class OutputText(_Body):
    """Text of an earlier answer, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[dict] | None, at_most(B.MAX_ANNOTATIONS), nested_at_most()] = None
    logprobs: Annotated[list[dict] | None, at_most(B.MAX_TOKEN_IDS), nested_at_most()] = None  # one a token


class Message(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]],
                       at_most(B.MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if not isinstance(p, InputImage))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: the text, or with images its text and image_url parts in order."""
        if isinstance(self.content, str) or not any(isinstance(p, InputImage) for p in self.content):
            return self.text()
        return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, InputImage)
                else {"type": "text", "text": p.text} for p in self.content]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    """An item's ``type`` (a message may leave it out, as OpenAI's easy input messages do)."""
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


InputItem = Annotated[Annotated[Message, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutput, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: Annotated[dict | None, nested_at_most()] = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """``text.format``: text, a JSON object, or JSON following a schema (ember's structured output)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict | None, nested_at_most()] = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a model's length is its own


class ResponsesRequest(_Body):
    model: str | None = None
    input: Annotated[str | list[InputItem], at_most(B.MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool] | None, at_most(B.MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[_MetadataKey, _MetadataValue] | None, at_most(B.MAX_METADATA)] = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    stream_options: Annotated[dict | None, nested_at_most(keys=B.MAX_KEYS)] = None
    # extra output fields: none are offered (an empty list is what clients send)
    include: Annotated[list[str] | None, at_most(B.MAX_INCLUDE)] = None
    # declared only to be refused by name when not null
    reasoning: None = None
    prompt: None = None
    conversation: None = None
    service_tier: None = None
    prompt_cache_key: None = None
    safety_identifier: None = None
    max_tool_calls: None = None
    top_logprobs: None = None
