"""Text prompts for ``ember bench latency --prompts text``: requests whose answers copy what the prompt holds and
requests whose answers do not, rendered with the model's chat template and tokenized once here, so every backend
gets the same token ids. They measure what random-token prompts cannot: how much of an answer a draft can guess.

- copy: "Copy this text" over a passage of the shipped Constitution text (ember/quantization/data);
- code: "Add a docstring to the first function and return the whole file" over a slice of one of ember's sources;
- chat: open questions whose answers are new text.

Each copy and code prompt also carries what OpenAI's predicted outputs would send with it (``prediction``): the
passage, and the file as given (the answer is that file with a docstring added); a chat prompt carries none. The
``ember-prediction`` backend sends them; the others never see them.
"""

from __future__ import annotations

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


def text_prompts(tokenizer: Tokenizer, count: int, seed: int = 0) -> list[tuple[str, list[int], list[int] | None]]:
    """``count`` prompts of each kind, as (kind, token ids, the prediction's token ids or None); the same arguments
    give the same prompts."""
    rng = random.Random(seed)
    with open(_DATA, encoding="utf-8") as f:
        text = f.read()
    here = os.path.dirname(os.path.dirname(__file__))
    out = []
    for i in range(count):
        start = rng.randrange(0, len(text) - 1700)
        start = text.index("\n", start) + 1  # from the start of a line
        passage = text[start:start + 1500].rsplit(" ", 1)[0]  # whole words
        out.append(("copy", f'Copy this text:\n\n"""{passage}"""', passage))
        with open(os.path.join(here, _SOURCES[i % len(_SOURCES)]), encoding="utf-8") as f:
            source = f.read()
        at = min(i for i in (source.find("\ndef "), source.find("\n    def ")) if i >= 0)  # the first function
        code = source[at + 1:at + 1 + 1200].rsplit("\n", 1)[0]
        block = f"```python\n{code}\n```"
        out.append(("code", "Add a docstring to the first function of this Python code and return the whole code:"
                            f"\n\n{block}", block))
        out.append(("chat", _QUESTIONS[i % len(_QUESTIONS)], None))
    rendered = []
    for kind, content, predicted in out:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        prediction = tokenizer.encode(predicted, add_special_tokens=False) if predicted is not None else None
        rendered.append((kind, tokenizer.encode(prompt, add_special_tokens=False), prediction))
    return rendered
