"""Perplexity of a text under an engine, from the prompt log-probabilities of the native API.

The text is cut into windows of ``window`` tokens; each window is one prompt, and every token after the first is
scored given the tokens before it in its window. The engine should run with a small step budget
(``max_num_batched_tokens``) so that a window is prefilled in chunks: later chunks then read the earlier ones from
the KV cache, which is what makes a quantized KV cache show in the figure. The project's fixed text is
tests/data/alice_ch1.txt (20 kB of public-domain English).
"""

from __future__ import annotations

import math
from typing import Any


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def perplexity(llm: Any, ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of ids, scored in windows of `window` tokens."""
    from ember import SamplingParams

    prompts = windows(ids, window)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outs):
        for token, position in zip(prompt[1:], out.prompt_logprobs[1:]):
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count)
