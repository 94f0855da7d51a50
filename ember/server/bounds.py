"""How much one request body may carry: a count limit on every list and mapping, and a nesting limit on the
free-form JSON values (schemas, template variables, annotations).

They are checked while the body is validated, so an oversized request is answered 400 naming the field, its size
and the limit before any work starts (rendering a template, tokenizing, compiling a grammar), and a deep schema never
reaches a recursive walker. Strings are bounded by the body limit (``--max-request-bytes``), prompts by
``max_model_len``, ``n`` by ``max_num_seqs`` (both checked by the engine before anything is queued).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

MAX_MESSAGES = 4096  # chat messages, Responses input items
MAX_CONTENT_PARTS = 512  # parts of one message's content (text, images)
MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOL_CALLS = 128  # calls in one assistant message
MAX_STOP = 64  # stop strings
MAX_TOKEN_IDS = 1 << 20  # one list of token ids (a prompt, stop_token_ids, /detokenize)
MAX_CHOICES = 1024  # guided_choice
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
MAX_KEYS = 64  # top-level keys of chat_template_kwargs, structured_outputs, Responses stream_options
MAX_ANNOTATIONS = 1024  # annotations of an output text sent back (its logprobs: one a token, MAX_TOKEN_IDS)
MAX_INCLUDE = 16  # Responses include
MAX_METADATA = 16  # Responses metadata pairs, each key <= 64 and value <= 512 characters (OpenAI's limits)
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
MAX_JSON_DEPTH = 64  # nesting of a free-form JSON value (a schema of 30 nested objects is 61 deep)


def at_most(limit: int) -> AfterValidator:
    """A list or mapping of at most ``limit`` items (a string given instead, as ``stop`` allows, is one item)."""
    def check(value: Any) -> Any:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise PydanticCustomError("too_many", "holds {count} items, more than the limit of {limit}",
                                      {"count": len(value), "limit": limit})
        return value

    return AfterValidator(check)


def prompts_at_most(limit: int, noun: str = "prompts") -> AfterValidator:
    """A prompt field (a string, token ids, or a list of those): at most ``limit`` prompts (``noun``: what the API
    calls them), each list of token ids at most ``MAX_TOKEN_IDS`` long."""
    def check(value: Any) -> Any:
        many = isinstance(value, list) and bool(value) and not isinstance(value[0], int)
        prompts = value if many else [value]
        if len(prompts) > limit:
            raise PydanticCustomError("too_many", "holds {count} {noun}, more than the limit of {limit}",
                                      {"count": len(prompts), "noun": noun, "limit": limit})
        longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
        if longest > MAX_TOKEN_IDS:
            raise PydanticCustomError("too_many", "holds a list of {count} token ids, more than the limit of {limit}",
                                      {"count": longest, "limit": MAX_TOKEN_IDS})
        return value

    return AfterValidator(check)


def depth(value: Any) -> int:
    """How deeply lists and mappings nest in a JSON value (a scalar: 0, ``{}``: 1), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _parsed(text: Any) -> Any:
    """JSON text as its value, to measure (a string that is not JSON is left as it is, for its own check to name;
    text nested past Python's parser counts as deeper than any limit)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
    except RecursionError:
        return _TOO_DEEP


_TOO_DEEP = object()


def nested_at_most(limit: int = MAX_JSON_DEPTH, keys: int | None = None, text: bool = False,
                   text_keys: tuple[str, ...] = ()) -> AfterValidator:
    """A free-form JSON value nested at most ``limit`` deep (and, given ``keys``, with at most that many keys at its
    top). text: a string value is JSON text, measured as what it holds; text_keys: the keys of a mapping whose string
    values are JSON text (``structured_outputs.json``)."""
    def check(value: Any) -> Any:
        if keys is not None and isinstance(value, dict) and len(value) > keys:
            raise PydanticCustomError("too_many", "holds {count} keys, more than the limit of {limit}",
                                      {"count": len(value), "limit": keys})
        held = [_parsed(value) if text else value]
        if isinstance(value, dict):
            held += [_parsed(value[k]) for k in text_keys if isinstance(value.get(k), str)]
        if any(v is _TOO_DEEP for v in held):
            raise PydanticCustomError("too_deep", "is JSON text nested too deep to parse, more than the limit of "
                                      "{limit} levels", {"limit": limit})
        found = max(depth(v) for v in held)
        if found > limit:
            raise PydanticCustomError("too_deep", "is nested {depth} levels deep, more than the limit of {limit}",
                                      {"depth": found, "limit": limit})
        return value

    return AfterValidator(check)
