"""A chat template rendered with jinja2 the way transformers renders it, without importing transformers.

transformers' ``apply_chat_template`` compiles the template in a sandboxed jinja2 environment (trim_blocks,
lstrip_blocks, loop controls, a ``generation`` tag) with a few helpers (tojson that keeps non-ASCII text,
raise_exception, strftime_now), drops message keys whose value is None and renders with the tokenizer's special
tokens as variables. This module sets up the same environment; tests/unit/frontend/test_chat_template.py renders templates of
several families against transformers. What it does not cover (callable tools, continue_final_message, named
templates, assistant masks, non-JSON values) raises ``Unsupported`` and the caller uses transformers instead.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers fills each from the others


class Unsupported(Exception):
    """The request needs transformers' renderer."""


def render(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, str],
           add_generation_prompt: bool = True, **kwargs: Any) -> str:
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    for name in ("continue_final_message", "chat_template", "return_assistant_tokens_mask", "tokenize"):
        if kwargs.get(name):
            raise Unsupported(name)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise Unsupported("tools given as functions")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise Unsupported("documents that are not dicts")  # transformers names the error
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise Unsupported("messages that are not dicts")
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    variables = {**special_tokens, **{k: _plain(v) for k, v in kwargs.items()}}
    return _compile(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                     add_generation_prompt=add_generation_prompt, **variables)


def _plain(value: Any) -> Any:
    """JSON-like data only (what a template may safely see); anything else goes to transformers' renderer."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    raise Unsupported(f"a value of type {type(value).__name__}")


class _Dict:
    """dict() and dict.fromkeys() for templates, without handing them the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, as transformers' sandbox does."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=Namespace)
    return env.from_string(template)
