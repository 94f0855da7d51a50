"""The fixed, seeded request lists of ``ember bench``.

Prompts are random token ids (as vLLM's and nano-vllm's "random" datasets), drawn from the model's vocabulary
without special tokens, so every backend gets the identical tokens with no tokenizer in the way. Outputs ignore EOS,
so each request produces exactly ``max_tokens`` tokens on every backend.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    prediction_token_ids: list[int] | None = None  # the answer's expected tokens (--prompts text): ember-prediction's
    stop_at_eos: bool = False  # the answer ends at EOS (--prompts json: a JSON record), not after max_tokens

    def to_json(self) -> dict:
        out = {"prompt_token_ids": self.prompt_token_ids, "max_tokens": self.max_tokens}
        if self.prediction_token_ids is not None:
            out["prediction_token_ids"] = self.prediction_token_ids
        if self.stop_at_eos:
            out["stop_at_eos"] = True
        return out


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    description: str
    num_requests: int
    prompt_len: tuple[int, int]    # inclusive range of the part unique to each request
    output_len: tuple[int, int]    # inclusive range
    shared_prefix: int = 0         # tokens of one prompt prefix that every request starts with


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("W1", "mixed: 64 requests, prompts 16-512 tokens, outputs 16-256 tokens", 64, (16, 512), (16, 256)),
    Workload("W2", "shared prefix: 64 requests, one 384-token system prompt + 16-64-token suffixes, 64 output "
                   "tokens", 64, (16, 64), (64, 64), shared_prefix=384),
    Workload("W3", "long: 8 requests with 1,500-token prompts, 128 output tokens", 8, (1500, 1500), (128, 128)),
    Workload("W4", "nano-vllm: 256 requests, prompts and outputs 100-1024 tokens (meant for a GPU)", 256,
             (100, 1024), (100, 1024)),
)}


def vocabulary(vocab_size: int, special_ids: set[int]) -> list[int]:
    return [i for i in range(vocab_size) if i not in special_ids]


def build_requests(workload: Workload, vocab: list[int], seed: int = 0, num_requests: int | None = None,
                   output_cap: int | None = None, prompt_cap: int | None = None) -> list[BenchRequest]:
    """The workload's request list; the same arguments give the same list on every machine.

    ``num_requests``, ``output_cap`` and ``prompt_cap`` shrink a workload (for tests and quick looks); they keep the
    seeded draws of the requests that remain.
    """
    if not vocab:
        raise ValueError("vocab is empty: the tokenizer has no ordinary tokens to draw prompts from")
    rng = random.Random(seed)
    prefix = [rng.choice(vocab) for _ in range(workload.shared_prefix)]
    out = []
    for _ in range(workload.num_requests):
        n_prompt = rng.randint(*workload.prompt_len)
        n_out = rng.randint(*workload.output_len)
        prompt = prefix + [rng.choice(vocab) for _ in range(n_prompt)]
        out.append(BenchRequest(prompt[:prompt_cap] if prompt_cap else prompt,
                                min(n_out, output_cap) if output_cap else n_out))
    return out[:num_requests] if num_requests is not None else out


def fixed_requests(prompt_len: int, output_len: int, count: int, vocab: list[int], seed: int = 0) -> list[BenchRequest]:
    """``count`` distinct prompts of exactly ``prompt_len`` tokens (the latency benchmark's inputs)."""
    rng = random.Random(seed * 1_000_003 + prompt_len)
    return [BenchRequest([rng.choice(vocab) for _ in range(prompt_len)], output_len) for _ in range(count)]
