"""A reply's thinking apart from its answer: ``<think>...</think>`` (Qwen3, DeepSeek-R1, SmolLM3 style).

``split(text, final, thinking)`` -> (reasoning, content). ``thinking``: the prompt already opened the thinking (a
template that ends the generation prompt with ``<think>``, as DeepSeek-R1's does), so the reply starts inside it;
otherwise a reply that starts with ``<think>`` thinks first and any other reply is all content. A reply that ends
inside its thinking (cut by max_tokens) is all reasoning. Like the tool parsers, the answer for a prefix of the text
is a prefix of the answer for any longer text (the end tag's first characters are held back), so streamed deltas
do not depend on token boundaries.
"""

from __future__ import annotations

from ember.server.tool_parsers import WHITESPACE as _WS
from ember.server.tool_parsers import held

START, END = "<think>", "</think>"


def split(text: str, final: bool, thinking: bool) -> tuple[str, str]:
    start = 0
    if not thinking:
        i = len(text) - len(text.lstrip(_WS))
        if text.startswith(START, i):
            start = i + len(START)
        elif not final and START.startswith(text[i:]):
            return "", ""  # whitespace or the tag's first characters: not known yet
        else:
            return "", text
    k = text.find(END, start)
    if k < 0:
        reasoning = text[start:]
        return (reasoning if final else reasoning[:len(reasoning) - held(reasoning, END)]), ""
    return text[start:k], text[k + len(END):].lstrip(_WS)


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block (its last tag is an open ``<think>``)."""
    return prompt_tail.rstrip(_WS).endswith(START)


REASONING_CHOICES = ("auto", "none", "deepseek_r1", "qwen3")  # the last two name the same <think> format


def resolve(setting: str, template: str) -> bool:
    """The server's --reasoning-parser for one model: "auto" splits thinking out where the chat template knows
    the end tag."""
    if setting not in REASONING_CHOICES:
        raise ValueError(f"reasoning_parser={setting!r} is not supported: use one of {', '.join(REASONING_CHOICES)}")
    return END in template if setting == "auto" else setting != "none"
