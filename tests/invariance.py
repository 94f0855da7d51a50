"""Batch invariance, checked end to end: a greedy request's tokens and logprobs (the chosen token's and the top
alternatives', compared to the bit) must be those it gets alone, whatever runs beside it.

``check(model, **engine)`` runs the cases and returns what differed (an empty list: invariant). Run as a script
(``python tests/invariance.py MODEL '{"dtype": "bfloat16"}'``) it prints that list as JSON: the tests run it in a
process of its own where the AVX-512 kernels are emulated (EMBER_EMULATE_AVX512=1).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from ember import LLM, SamplingParams

MAX_TOKENS = 10


def _key(out) -> list[tuple[tuple[int, ...], list[dict[int, float]]]]:
    """Every sample's tokens and, position by position, the logprobs returned (chosen token and top 3)."""
    return [(tuple(o.token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs])
            for o in sorted(out.outputs, key=lambda o: o.index)]


def _prompts(llm: LLM, rng: random.Random, count: int, low: int = 5, high: int = 70) -> list[list[int]]:
    vocab = llm.model_info.vocab_size
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def check(model: str | None, sizes: tuple[int, ...] = (2, 8, 24, 64), probes: list[list[int]] | None = None,
          seed: int = 0, **engine: Any) -> list[str]:
    """Each probe alone is the reference; then: in batches of ``sizes`` at random positions beside random prompts,
    as n = 3 samples, prefilled in chunks of 16 tokens, after prefix-cache hits (its own prompt, and a follow-up
    turn whose cached blocks hold K/V its answer was decoded with), and in a batch whose KV pool is too small, so
    that sequences are preempted and recomputed. On the CPU unless ``device`` is given: the CUDA path is not batch
    invariant yet (docs/cuda.md)."""
    engine.setdefault("device", "cpu")
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    problems: list[str] = []

    def same(case: str, got, want) -> None:
        if got != want:
            problems.append(case)

    plain = LLM(model, enable_prefix_caching=False, **engine)
    try:
        probes = probes or _prompts(plain, rng, 3)
        refs = [_key(o)[0] for o in plain.generate(probes[:1], greedy, use_tqdm=False)]
        refs += [_key(plain.generate([p], greedy, use_tqdm=False)[0])[0] for p in probes[1:]]
        for size in sizes:
            batch = _prompts(plain, rng, size)
            at = rng.sample(range(size), min(len(probes), size))
            for i, pos in enumerate(at):
                batch[pos] = probes[i]
            outs = plain.generate(batch, greedy, use_tqdm=False)
            for i, pos in enumerate(at):
                same(f"probe {i} in a batch of {size} at {pos}", _key(outs[pos])[0], refs[i])
        three = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
        for i, p in enumerate(probes):
            out = plain.generate([p], three, use_tqdm=False)[0]
            for j, sample in enumerate(_key(out)):
                same(f"probe {i} sample {j} of n=3", sample, refs[i])
        # the follow-up turn: the probe, its answer, more text; computed from scratch here
        follow = [p + list(r[0]) + [101, 102, 103] for p, r in zip(probes, refs)]
        follow_refs = [_key(plain.generate([f], greedy, use_tqdm=False)[0])[0] for f in follow]
    finally:
        plain.shutdown()

    tight = LLM(model, **(engine | dict(enable_prefix_caching=True, max_num_batched_tokens=16, max_kv_cache_tokens=256,
                                        max_model_len=256)))
    try:
        for i, p in enumerate(probes):
            same(f"probe {i} prefilled in chunks of 16", _key(tight.generate([p], greedy, use_tqdm=False)[0])[0],
                 refs[i])
            same(f"probe {i} from the prefix cache", _key(tight.generate([p], greedy, use_tqdm=False)[0])[0],
                 refs[i])
            # the answer's blocks were cached as decode wrote them; this turn's prefill reads them
            tight.generate([p], greedy, use_tqdm=False)
            same(f"probe {i}'s follow-up turn over its cached answer",
                 _key(tight.generate([follow[i]], greedy, use_tqdm=False)[0])[0], follow_refs[i])
        before = tight.stats()["preemptions"]
        batch = _prompts(tight, rng, 12, 30, 60) + probes
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = tight.generate(batch, [long] * 12 + [greedy] * len(probes), use_tqdm=False)
        if tight.stats()["preemptions"] == before:
            problems.append("the preemption case preempted nothing (the pool is too large for it)")
        for i in range(len(probes)):
            same(f"probe {i} in a batch with preemptions", _key(outs[12 + i])[0], refs[i])
    finally:
        tight.shutdown()
    return problems


if __name__ == "__main__":
    settings = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    sizes = tuple(settings.pop("sizes", (2, 8, 24, 64)))
    print(json.dumps(check(sys.argv[1], sizes=sizes, **settings)))
