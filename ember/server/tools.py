"""A chat request's tools: what the template is shown, which parser reads the reply, and the constraint that
``tool_choice`` "required" or a named function puts on it.

The parser is the server's ``--tool-call-parser`` or, by default, the one the model's chat template teaches (the
template names its markers: ``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``). With "required" or a named
function the reply is constrained by an llguidance grammar to the model's own call format around JSON that follows
each function's parameter schema, so every call parses and matches its schema; the same parser reads it back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.errors import BadRequestError
from ember.frontend.structured_output import JSON_WHITESPACE, no_additional_properties
from ember.sampling_params import StructuredOutputsParams
from ember.server.tool_parsers import PARSERS

TOOL_PARSER_CHOICES = ("auto", "none", *PARSERS)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# whitespace the constrained call JSON may hold between tokens: one space at most, as the call formats are written
# in the templates and the models' training; any more lets a small model fill every gap (a random model ran to
# max_tokens in whitespace with structured output's default of up to 20 characters)
_JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}


def template_parser(template: str) -> str | None:
    """The call format a chat template teaches, from the markers it names; None: none ember knows."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


def resolve_parser(setting: str, template: str) -> str | None:
    """The server's --tool-call-parser for one model: "auto" reads the template, "none" turns tools off."""
    if setting not in TOOL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser={setting!r} is not supported: use one of {', '.join(TOOL_PARSER_CHOICES)}")
    if setting == "none":
        return None
    return template_parser(template) if setting == "auto" else setting


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template renders (None: no tools)
    parser: str | None  # how the reply is read (None: all content)
    constraint: StructuredOutputsParams | None  # "required" / a named function


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: str | None,
         token_of: Callable[[str], int | None] = lambda _: None, answer: dict | None = None) -> ToolPlan:
    """tools, tool_choice, parallel_tool_calls of a chat body (pydantic models or None) -> the plan; a choice
    that cannot be served is refused naming the field. token_of: the id of a marker the vocabulary holds as one
    token (None: the marker is plain text). answer: the JSON schema of a response format: with tool_choice auto
    the reply is calls or that JSON (a grammar of both); with a required or named call, the call."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise BadRequestError(f"tool_choice={shown(tool_choice)} needs tools: the request has none")
        return ToolPlan(None, None, None)
    functions = [t.function for t in tools]
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if not _NAME.fullmatch(name):
            raise BadRequestError(f"tools[{i}].function.name={name!r} is not allowed: a name is 1-64 letters, digits, "
                                  "'_', '.' or '-'")
        if name in names[:i]:
            raise BadRequestError(f"tools[{i}].function.name={name!r} is given twice: tool names must be unique")
    rendered = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan(rendered, None, None)
    if parser is None:
        raise BadRequestError("tools cannot be used with this model: its chat template shows no tool-call format ember "
                              "knows; start the server with --tool-call-parser (one of " + ", ".join(PARSERS) + ")")
    if choice == "auto":
        if answer is None:
            return ToolPlan(rendered, parser, None)
        grammar = call_grammar(parser, functions, parallel is not False, token_of, answer)
        return ToolPlan(rendered, parser, StructuredOutputsParams(grammar=grammar))
    if choice == "required":
        chosen = functions
    else:
        name = choice.function.name
        if name not in names:
            raise BadRequestError(f"tool_choice.function.name={name!r} is not one of the request's tools "
                                  f"({', '.join(names)})")
        chosen = [functions[names.index(name)]]
    many = parallel is not False and choice == "required"
    return ToolPlan(rendered, parser, StructuredOutputsParams(grammar=call_grammar(parser, chosen, many, token_of)))


def shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())


def call_grammar(parser: str, functions: list[Any], many: bool,
                 token_of: Callable[[str], int | None] = lambda _: None, answer: dict | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for one call (or, many, one or more) of the given functions in the
    parser's format; answer: a JSON schema the reply may follow instead (tool_choice auto with a response
    format). A marker the vocabulary holds as one token (Qwen's ``<tool_call>``, Mistral's control token
    ``[TOOL_CALLS]``) is that token, as the model writes it."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": f.name}, key: _parameters(f)},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = {"x-guidance": _JSON_LAYOUT, **(options[0] if len(options) == 1 else {"anyOf": options})}

    def marker(text: str) -> str:
        token = token_of(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    lines = [f"call_json: %json {json.dumps(schema)}"]
    if parser == "hermes":
        lines.append(f'call: {marker("<tool_call>")} "\\n" call_json "\\n" {marker("</tool_call>")}')
        lines.insert(0, 'start: call ("\\n" call)*' if many else "start: call")
    elif parser == "llama3_json":
        lines.insert(0, 'start: call_json ("; " call_json)*' if many else "start: call_json")
    else:
        calls = 'call_json (", " call_json)*' if many else "call_json"
        lines.insert(0, f'start: {marker("[TOOL_CALLS]")} "[" {calls} "]"')
    if answer is not None:  # the calls' rule becomes one choice of two
        lines[0] = lines[0].replace("start:", "calls:", 1)
        layout = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        lines[:0] = ["start: calls | answer", f"answer: %json {json.dumps({'x-guidance': layout, **answer})}"]
    return "\n".join(lines)


def _parameters(function: Any) -> dict[str, Any]:
    """A function's parameter schema, its objects closed to properties it does not name (unless it says
    otherwise), as OpenAI's strict function calling has them: a model does not invent arguments."""
    params = function.parameters
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return no_additional_properties(params)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as chat templates read them: assistant tool calls with their arguments as objects (the
    templates dump them with tojson; OpenAI clients send them as JSON text), tool results with their call's id."""
    out = []
    for m in messages:
        # text parts joined; with images, the parts as they are (the client takes the images out)
        content = [p.model_dump(exclude_none=True) for p in m.content] if m.has_images() else m.text()
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.role == "assistant" and m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
