"""One choice's reply as OpenAI's message parts: ``reasoning_content``, ``content`` and ``tool_calls``.

The reasoning split (``reasoning.split``) and the tool parser (``tool_parsers.parse``) are functions of the text so
far; a ``ReplyParser`` keeps what it already said and hands out only what is new, as a chat delta. The parse runs
on the whole text at each piece: the content-only path is a ``str.find`` and the scanning is confined to call
blocks, which are short.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ember.server import reasoning as _reasoning
from ember.server.tool_parsers import parse


_STARTS = "<{[`"  # the first characters of every marker, call object and fence the parsers look for


def call_id(parser: str | None = None) -> str:
    """A tool call's id. Mistral's chat templates refuse a conversation whose call ids are not 9 letters or digits
    (the client sends them back with the tool results), so its calls get such ids, as vLLM gives them."""
    return uuid.uuid4().hex[:9] if parser == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    """How a request's replies are read: the tool parser (None: no tools), whether ``<think>`` text is split out,
    and whether the prompt already opened the thinking."""

    tools: str | None = None
    reasoning: bool = False
    thinking: bool = False
    names: tuple[str, ...] = ()  # the request's tools
    single: bool = False  # parallel_tool_calls=false: at most one call, the first (as vLLM)

    def parser(self) -> "ReplyParser":
        return ReplyParser(self.tools, self.reasoning, self.thinking, self.names, self.single)


class ReplyParser:
    """feed(text) -> the chat delta fields that became certain (final=True with the last piece). ``tools``: the
    tool parser (None: no tools, all content); ``reasoning``: split ``<think>`` text out; ``thinking``: the prompt
    opened it."""

    __slots__ = ("tools", "reasoning", "thinking", "names", "single", "text", "_reasoning", "_content", "calls",
                 "_args", "_plain")

    def __init__(self, tools: str | None, reasoning: bool, thinking: bool = False, names: tuple[str, ...] = (),
                 single: bool = False) -> None:
        self.tools, self.reasoning, self.thinking, self.names = tools, reasoning, thinking, names
        self.single = single  # parallel_tool_calls=false: the calls after the first are dropped
        self.text = ""
        self._reasoning = self._content = ""  # what was said so far
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool_calls of the message, arguments as said so far
        self._args: list[str] = []
        # no character that starts a marker, a call object or a fence has come yet (and the prompt opened no
        # thinking): the parse is the text itself, less trailing whitespace until the end, so it is not rerun
        self._plain = not thinking

    @property
    def thought(self) -> str:
        """The reasoning said so far."""
        return self._reasoning

    @property
    def passthrough(self) -> bool:
        return self.tools is None and not self.reasoning

    def feed(self, piece: str, final: bool = False) -> dict[str, Any]:
        """The delta fields piece made certain (final: the reply ends with it)."""
        self.text += piece
        if self.passthrough:
            return {"content": piece} if piece else {}
        if self._plain and not any(c in piece for c in _STARTS):
            content = self.text if final else self.text.rstrip(" \t\r\n")
            new, self._content = content[len(self._content):], content
            return {"content": new} if new else {}
        self._plain = False
        return self._update(final) if piece or final else {}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" for a reply that stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _update(self, final: bool) -> dict[str, Any]:
        thought, answer = (_reasoning.split(self.text, final, self.thinking) if self.reasoning
                           else ("", self.text))
        parsed = parse(self.tools, answer, final, self.names) if self.tools is not None else None
        content = parsed.content if parsed is not None else answer
        delta: dict[str, Any] = {}
        if len(thought) > len(self._reasoning):
            delta["reasoning_content"] = thought[len(self._reasoning):]
            self._reasoning = thought
        if len(content) > len(self._content):
            delta["content"] = content[len(self._content):]
            self._content = content
        calls = []
        found = parsed.calls if parsed is not None else ()
        for i, (name, args) in enumerate(found[:1] if self.single else found):
            if i == len(self.calls):
                self.calls.append({"id": call_id(self.tools), "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                self._args.append("")
                calls.append({"index": i, "id": self.calls[i]["id"], "type": "function",
                              "function": {"name": name, "arguments": ""}})
            new = args[len(self._args[i]):]
            if new:
                self._args[i] = args
                self.calls[i]["function"]["arguments"] = args
                calls.append({"index": i, "function": {"arguments": new}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    @staticmethod
    def chunks(fields: dict[str, Any]) -> list[dict[str, Any]]:
        """A delta as OpenAI streams it: one tool-call entry a chunk (a call's id and name with empty arguments,
        then argument fragments), reasoning and content in the first."""
        calls = fields.get("tool_calls")
        if not calls or len(calls) == 1:
            return [fields]
        first = {k: v for k, v in fields.items() if k != "tool_calls"}
        return [{**first, "tool_calls": calls[:1]}, *({"tool_calls": [c]} for c in calls[1:])]

    def message(self) -> dict[str, Any]:
        """The whole reply as a chat message (after the final feed)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self._content if not self.passthrough else self.text}
        if self.reasoning:
            msg["reasoning_content"] = self._reasoning or None
        if self.calls:
            msg["content"] = msg["content"] or None
            msg["tool_calls"] = self.calls
        return msg
