"""Does a greedy request get the same answer whatever runs beside it? A probe over one model and device.

Each probe prompt runs alone (the reference), then in batches of 2..24 at a random position among random other
prompts, and again alone after its prompt blocks are in the prefix cache. A case counts as identical when the
greedy tokens are equal and every chosen token's logprob is equal to the bit.

    python benchmarks/batch_invariance.py [--model PATH] [--device cpu|cuda] [--dtype auto|bfloat16|...]
        [--max-tokens 24] [--seed 0] [--out FILE.json] [-- engine keyword=value ...]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from ember import LLM, SamplingParams

PROBES = ["What is the capital of France?", "Write a haiku about rain.", "def fib(n):",
          "List three prime numbers greater than 100."]
FILLERS = ["Tell me a story about a dragon.", "How do airplanes fly?", "Explain recursion to a child.",
           "What is 17 times 23?", "Name the planets of the solar system.", "Translate 'good morning' to Spanish.",
           "Why is the sky blue?", "Write a limerick about a cat.", "Summarize the plot of Hamlet.",
           "What is a linked list?", "Give me a recipe for pancakes.", "Describe the water cycle."]


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.client.chat_prompt([{"role": "user", "content": text}], True)


def _key(out) -> tuple[list[int], list[float]]:
    o = out.outputs[0]
    return o.token_ids, [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="2,4,8,16,24")
    ap.add_argument("--out", default=None)
    ap.add_argument("engine", nargs="*", help="extra engine settings as key=value (Python literals)")
    a = ap.parse_args()
    extra = {}
    for kv in a.engine:
        k, v = kv.split("=", 1)
        try:
            extra[k] = eval(v, {})  # noqa: S307 - a developer's own command line
        except Exception:
            extra[k] = v
    llm = LLM(a.model, device=a.device, dtype=a.dtype, enable_prefix_caching=False, **extra)
    cached = LLM(a.model, device=a.device, dtype=a.dtype, enable_prefix_caching=True, **extra) \
        if a.device != "cuda" else None
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, logprobs=0, ignore_eos=True)
    rng = random.Random(a.seed)
    prompts = {p: _chat(llm, p) for p in PROBES + FILLERS}
    rows, t0 = [], time.perf_counter()
    for probe in PROBES:
        ref = _key(llm.generate([prompts[probe]], params, use_tqdm=False)[0])
        for size in [int(s) for s in a.sizes.split(",")]:
            batch = [prompts[rng.choice(FILLERS)] for _ in range(size - 1)]
            at = rng.randrange(size)
            batch.insert(at, prompts[probe])
            got = _key(llm.generate(batch, params, use_tqdm=False)[at])
            rows.append(_row(probe, f"batch {size} @ {at}", ref, got))
        if cached is not None:
            first = _key(cached.generate([prompts[probe]], params, use_tqdm=False)[0])
            again = _key(cached.generate([prompts[probe]], params, use_tqdm=False)[0])
            rows.append(_row(probe, "prefix cache: first", ref, first))
            rows.append(_row(probe, "prefix cache: hit", ref, again))
    same = sum(r["identical"] for r in rows)
    for r in rows:
        print(f"{r['probe'][:28]:28s} {r['case']:22s} {'same' if r['identical'] else 'DIFFERS':7s} "
              f"tokens {'=' if r['tokens_equal'] else '!='}  max |dlogprob| {r['max_dlogprob']:.3g}")
    print(f"{same} / {len(rows)} identical ({time.perf_counter() - t0:.0f} s, model info {llm.model_info})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "device": a.device, "rows": rows, "identical": same}, f, indent=1)


def _row(probe: str, case: str, ref, got) -> dict:
    n = min(len(ref[1]), len(got[1]))
    first_diff = next((i for i in range(n) if ref[0][i] != got[0][i]), n)
    dl = max((abs(x - y) for x, y in zip(ref[1][:first_diff], got[1][:first_diff])), default=0.0)
    return {"probe": probe, "case": case, "tokens_equal": ref[0] == got[0], "identical": ref == got,
            "max_dlogprob": dl}


if __name__ == "__main__":
    main()
