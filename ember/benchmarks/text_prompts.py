"""Text prompts for ``ember bench latency --prompts text``: requests whose answers copy what the prompt holds and
requests whose answers do not, rendered with the model's chat template and tokenized once here, so every backend
gets the same token ids. They measure what random-token prompts cannot: how much of an answer a draft can guess.

- copy: "Copy this text" over a passage of the shipped Constitution text (ember/quantization/data);
- code: "Add a docstring to the first function and return the whole file" over a slice of one of ember's sources;
- chat: open questions whose answers are new text.

Each copy and code prompt also carries what OpenAI's predicted outputs would send with it (``prediction``): the
passage, and the file as given (the answer is that file with a docstring added); a chat prompt carries none. The
``ember-prediction`` backend sends them; the others never see them.

``record_prompts`` (``--prompts json``): a book's library listing above a passage of the same text, and the ask
for its record as JSON, whose structure the guided backends' schema (``runner.GUIDED_SCHEMA``) fixes and whose
values copy the listing.
"""

from __future__ import annotations

import json
import os
import random

from ember.tokenizer import Tokenizer

_DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "quantization", "data", "calibration.txt")
_SOURCES = ("core/scheduler.py", "core/block_manager.py", "core/ngram.py", "frontend/detokenizer.py",
            "layers/sampler.py", "worker/input_batch.py")
_QUESTIONS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
              "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
              "What are the pros and cons of working from home? Answer in a few paragraphs.",
              "Describe a walk through a busy market in a city you imagine.",
              "Give me advice on learning to play the piano as an adult.",
              "Why is the sky blue? Explain it step by step.",
              "Write a letter to a friend about a trip to the mountains.")
KINDS = ("copy", "code", "chat")
Prompt = tuple[str, list[int], list[int] | None]  # kind, token ids, the prediction's token ids or None
_SHELVES = ("fiction", "history", "law", "science", "travel", "poetry", "biography", "drama", "mystery",
            "adventure", "philosophy", "politics")


def text_prompts(tokenizer: Tokenizer, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of each kind, as (kind, token ids, the prediction's token ids or None); the same arguments
    give the same prompts."""
    rng, text = random.Random(seed), _shipped_text()
    here = os.path.dirname(os.path.dirname(__file__))
    out = []
    for i in range(count):
        passage = _passage(rng, text, 1500, 200)
        out.append(("copy", f'Copy this text:\n\n"""{passage}"""', passage))
        with open(os.path.join(here, _SOURCES[i % len(_SOURCES)]), encoding="utf-8") as f:
            source = f.read()
        at = min(i for i in (source.find("\ndef "), source.find("\n    def ")) if i >= 0)  # the first function
        code = source[at + 1:at + 1 + 1200].rsplit("\n", 1)[0]
        block = f"```python\n{code}\n```"
        out.append(("code", "Add a docstring to the first function of this Python code and return the whole code:"
                            f"\n\n{block}", block))
        out.append(("chat", _QUESTIONS[i % len(_QUESTIONS)], None))
    return _render(tokenizer, out)


def record_prompts(tokenizer: Tokenizer, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of kind "record": a listing (title, year, shelves) above a passage, and the ask for the
    book's record as JSON (title, year, tags); the prediction is that record. The same arguments give the same
    prompts."""
    rng, text = random.Random(seed), _shipped_text()
    out = []
    for _ in range(count):
        passage = _passage(rng, text, 600, 300).strip()
        words = [w.strip(".,;:()\"'") for w in passage.split()]
        title = " ".join(w.capitalize() for w in rng.sample([w for w in words if len(w) > 3 and w.isalpha()], 3))
        year, tags = rng.randrange(1850, 2025), rng.sample(_SHELVES, 3)
        listing = f"Title: {title}\nFirst published: {year}\nShelved under: {', '.join(tags)}\n\n{passage}"
        out.append(("record", f"Here is a library listing:\n\n{listing}\n\nReply with the book's record as JSON: its "
                              "title, year and tags.", json.dumps({"title": title, "year": year, "tags": tags})))
    return _render(tokenizer, out)


def _shipped_text() -> str:
    with open(_DATA, encoding="utf-8") as f:
        return f.read()


def _passage(rng: random.Random, text: str, length: int, slack: int) -> str:
    """Whole words of up to ``length`` characters of text, from the start of a line after a place drawn at least
    length + slack characters before its end."""
    start = text.index("\n", rng.randrange(0, len(text) - length - slack)) + 1
    return text[start:start + length].rsplit(" ", 1)[0]


def _render(tokenizer: Tokenizer, out: list[tuple[str, str, str | None]]) -> list[Prompt]:
    """Each (kind, user message, prediction text) through the chat template, tokenized."""
    rendered = []
    for kind, content, predicted in out:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        prediction = tokenizer.encode(predicted, add_special_tokens=False) if predicted is not None else None
        rendered.append((kind, tokenizer.encode(prompt, add_special_tokens=False), prediction))
    return rendered
