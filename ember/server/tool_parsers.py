"""Tool calls out of a model's text, in the formats of the families ember serves.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 / Qwen3, Hermes); a
  reply that starts with such objects without the tags (bare or in a ```json fence) naming the request's tools,
  as small models write them;
- ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` objects joined by ``;`` (optionally after
  ``<|python_tag|>``), as Llama 3.1-3.3's templates ask;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

``parse(kind, text, final)`` says what a reply's text holds: its content and its calls (name, argument text).
Before the end (``final=False``) it holds back what the next text could still change (a marker's first
characters, trailing whitespace, a block whose name is not out yet), so the answer for a prefix is a prefix of the
answer for any longer text: a streamed reply (``reply.ReplyParser``) says the same whatever its token boundaries,
and the same as the whole reply parsed at once (the tests try every split). Arguments are the model's own JSON text,
cut out of the call object by a scanner that knows strings and nesting, so a closing tag inside an argument string
stays in the argument. A block that is not a call object (no name, broken before its name) is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")

WHITESPACE = _WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[ \t\r\n,}\]]")
_CLOSES = {"}": "{", "]": "["}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A reply's text as content and calls: (name, arguments as the model wrote them)."""

    content: str
    calls: tuple[tuple[str, str], ...] = ()


class _Malformed(Exception):
    def __init__(self, at: int) -> None:
        self.at = at


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote; None while the string is open."""
    m = _STRING.match(s, i)
    return m.end() if m else None


def _value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i]; None while it may go on (open, or a scalar reaching the
    end of the text). A bracket that does not match raises _Malformed at its index."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        stack, j = [c], i + 1
        while (m := _STRUCTURE.search(s, j)) is not None:
            j, c = m.start(), m.group()
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append(c)
            elif _CLOSES[c] != stack.pop():
                raise _Malformed(j)
            elif not stack:
                return j + 1
            j += 1
        return None
    m = _SCALAR_END.search(s, i)
    if m is None:
        return None
    if m.start() == i:
        raise _Malformed(i)
    return m.start()


@dataclass(slots=True)
class _Object:
    """A call object as far as the text goes."""

    name: str | None = None
    args_start: int | None = None  # the arguments value's first character
    args_end: int | None = None  # the index after it; None while it is open
    end: int | None = None  # the index after the object's "}"; None while it is open
    bad: int | None = None  # where the JSON broke

    def arguments(self, s: str) -> str:
        if self.args_start is None:
            return "{}" if self.end is not None or self.bad is not None else ""
        stop = self.args_end if self.args_end is not None else self.bad if self.bad is not None else len(s)
        return s[self.args_start:stop]

    @property
    def settled(self) -> bool:
        return self.end is not None or self.bad is not None


_ARGUMENT_KEYS = ("arguments", "parameters")


def _scan_object(s: str, i: int) -> _Object:
    """The call object starting at s[i] (its "{")."""
    out = _Object()
    try:
        _scan_members(s, i + 1, out)
    except _Malformed as e:
        out.bad = e.at
    return out


def _scan_members(s: str, i: int, out: _Object) -> None:
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return
        if s[i] == "}":
            out.end = i + 1
            return
        if s[i] != '"':
            raise _Malformed(i)
        key_end = _string_end(s, i)
        if key_end is None:
            return
        key = _loads(s, i, key_end)
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return
        if s[i] != ":":
            raise _Malformed(i)
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return
        if key in _ARGUMENT_KEYS and out.args_start is None:
            out.args_start = i
        end = _value_end(s, i)
        if end is None:
            return
        if key == "name":
            name = _loads(s, i, end)
            if not isinstance(name, str) or out.name is not None or not _utf8(name):
                raise _Malformed(i)
            out.name = name
        elif i == out.args_start:
            out.args_end = end
        i = _skip_ws(s, end)
        if i >= len(s):
            return
        if s[i] == ",":
            i += 1
        elif s[i] != "}":
            raise _Malformed(i)


def _utf8(name: str) -> bool:
    """Whether a decoded name can go out as UTF-8: an escaped lone surrogate ("\\ud800") decodes to one, which
    the reply's JSON encoding would fail on (a 500 instead of the text as content)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _loads(s: str, i: int, end: int) -> object:
    """A JSON string's value; a bad escape or a raw control character breaks the call object there."""
    try:
        return json.loads(s[i:end])
    except ValueError:
        raise _Malformed(i) from None


def held(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class _Reply:
    """Content and calls, gathered in the order the text has them."""

    def __init__(self, final: bool) -> None:
        self.final = final
        self.items: list[str | tuple[str, str]] = []  # content (adjacent pieces joined) and calls

    @property
    def has_calls(self) -> bool:
        return any(isinstance(item, tuple) for item in self.items)

    def content(self, piece: str, marker: str | None = None) -> None:
        if not self.final and marker:
            piece = piece[:len(piece) - held(piece, marker)]
        if self.items and isinstance(self.items[-1], str):
            self.items[-1] += piece
        else:
            self.items.append(piece)

    def call(self, name: str, arguments: str) -> None:
        self.items.append((name, arguments))

    def done(self) -> Parsed:
        """Whitespace next to a call is dropped (the text on either side of a call joined by one newline); before
        the end, trailing whitespace is held back (content only if more content follows)."""
        content, calls = [], []
        for i, item in enumerate(self.items):
            if isinstance(item, tuple):
                calls.append(item)
                continue
            if i > 0:
                item = item.lstrip(_WS)
            if i + 1 < len(self.items) or not self.final:
                item = item.rstrip(_WS)
            content.append(item)
        return Parsed("\n".join(c for c in content if c), tuple(calls))


def parse(kind: str, text: str, final: bool, names: tuple[str, ...] = ()) -> Parsed:
    """The content and calls of a reply's text (final: the whole reply; else a prefix of it). names: the request's
    tools; a hermes reply that is bare call objects of these tools, without the tags (small models drop them), is
    read as calls too."""
    if kind == "hermes":
        return _hermes(text, final, names)
    if kind == "llama3_json":
        return _llama3_json(text, final)
    if kind == "mistral":
        return _mistral(text, final)
    raise ValueError(f"tool_call_parser={kind!r} is not supported: use one of {', '.join(PARSERS)}")


_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"


_FENCE = "```"


def _hermes(text: str, final: bool, names: tuple[str, ...]) -> Parsed:
    reply, pos = _Reply(final), 0
    i = _skip_ws(text, 0)
    if names and text.startswith(_FENCE, i):  # a fenced block of bare calls: ```json {...} ```
        k = i + len(_FENCE)
        if not final and "json".startswith(text[k:]):
            return Parsed("")  # the language tag's first characters
        j = _skip_ws(text, k + (4 if text.startswith("json", k) else 0))
        if j >= len(text) and not final:
            return Parsed("")
        if j < len(text) and text[j] == "{":
            return _object_run(text, j, None, None, reply, text, names, fenced=True)
    elif names and not final and (_FENCE + "json").startswith(text[i:]) and text[i:]:
        return Parsed("")  # the fence's first characters
    if names and i < len(text) and text[i] == "{":
        return _object_run(text, i, None, None, reply, text, names)
    while True:
        k = text.find(_HERMES_START, pos)
        if k < 0:
            reply.content(text[pos:], _HERMES_START)
            return reply.done()
        reply.content(text[pos:k])
        pos = _hermes_block(text, k, k + len(_HERMES_START), reply)
        if pos is None:
            return reply.done()


def _hermes_block(text: str, start: int, body: int, reply: _Reply) -> int | None:
    """One block: its call (or its text as content); the index after it, None when the text ends inside it. The
    closing tag is expected right after the object; without it the block ends with the object and what follows
    is content or the next block."""
    i = _skip_ws(text, body)
    obj = _scan_object(text, i) if i < len(text) and text[i] == "{" else _Object(bad=i if i < len(text) else None)
    end = None
    if obj.bad is not None:  # broken JSON: the block runs to its closing tag or the next block
        end = _next_block(text, obj.bad)
        if end is None and reply.final:
            end = len(text)
    elif obj.end is not None:
        j = _skip_ws(text, obj.end)
        if text.startswith(_HERMES_END, j):
            end = j + len(_HERMES_END)
        elif reply.final or not _HERMES_END.startswith(text[j:]):
            end = obj.end
    if obj.name is not None:
        reply.call(obj.name, obj.arguments(text))
    elif end is not None or reply.final:
        reply.content(text[start:end])
    return end


def _next_block(text: str, i: int) -> int | None:
    """Where a broken block ends: after its closing tag, or at the next block's start, whichever comes first."""
    close, again = text.find(_HERMES_END, i), text.find(_HERMES_START, i)
    if close >= 0 and (again < 0 or close < again):
        return close + len(_HERMES_END)
    return again if again >= 0 else None


_PYTHON_TAG = "<|python_tag|>"


def _llama3_json(text: str, final: bool) -> Parsed:
    reply = _Reply(final)
    i = _skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = _skip_ws(text, i + len(_PYTHON_TAG))
    elif not final and _PYTHON_TAG.startswith(text[i:]):
        return Parsed("")  # nothing but whitespace or the tag's start yet
    if i >= len(text) and not final:
        return Parsed("")  # the tag and nothing after it yet
    if i >= len(text) or text[i] != "{":
        reply.content(text)
        return reply.done()
    return _object_run(text, i, ";", None, reply, text)


_MISTRAL_START = "[TOOL_CALLS]"


def _mistral(text: str, final: bool) -> Parsed:
    reply = _Reply(final)
    k = text.find(_MISTRAL_START)
    if k < 0:
        reply.content(text, _MISTRAL_START)
        return reply.done()
    reply.content(text[:k])
    i = _skip_ws(text, k + len(_MISTRAL_START))
    if i >= len(text):
        return reply.done()
    if text[i] == "[":
        return _object_run(text, _skip_ws(text, i + 1), ",", "]", reply, text[k:])
    return _object_run(text, i, ",", None, reply, text[k:])


def _object_run(text: str, i: int, sep: str | None, close: str | None, reply: _Reply, whole: str,
                names: tuple[str, ...] = (), fenced: bool = False) -> Parsed:
    """Call objects from text[i] joined by sep (None: whitespace) until close, if given; what follows is content
    (fenced: after the closing fence). whole: the run's text, content if it breaks before its first call has a
    name (or, names given, a name not among them)."""
    while i < len(text):
        if text[i] != "{":
            if close is not None and text[i] == close:
                i += 1
            break
        obj = _scan_object(text, i)
        if obj.name is not None and names and obj.name not in names:
            obj = _Object(bad=i)
        if obj.name is None:
            if obj.settled or reply.final:
                if not reply.has_calls:
                    reply.content(whole)
                    return reply.done()
                break  # the object's text and what follows it are content
            return reply.done()
        reply.call(obj.name, obj.arguments(text))
        if obj.end is None:
            return reply.done()
        j = _skip_ws(text, obj.end)
        if j >= len(text):
            return reply.done()
        if sep is None and text[j] == "{":
            i = j
            continue
        if text[j] != sep:
            i = j
            if close is not None and text[j] == close:
                i += 1
            break
        i = _skip_ws(text, j + 1)
    if fenced and reply.has_calls:
        i = _skip_ws(text, i)
        if text.startswith(_FENCE, i):
            i += len(_FENCE)
        elif not reply.final and _FENCE.startswith(text[i:]):
            return reply.done()  # the closing fence's first characters
    reply.content(text[i:])
    return reply.done()
