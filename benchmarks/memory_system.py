"""The memory system's two figures (issue 4), in one process on the default model, median of interleaved repeats.

1. Shared prefix (W2: 64 requests, one 384-token system prompt + 16-64-token suffixes, 64 output tokens): time to
   first token of requests 2..N with prefix caching on against off. Request 1 runs alone first (it fills the
   cache); requests 2..N then arrive together.
2. Policies: W1 (64 mixed requests) with a KV pool that holds a quarter of the workload's tokens, under
   max_utilization and guaranteed_no_evict: output tokens/s, wall time, preemptions.

    python benchmarks/memory_system.py --repeats 3 --out docs/bench/memory-system.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ember import LLM, SamplingParams
from ember.benchmarks.workloads import WORKLOADS, build_requests, vocabulary


def _params(reqs):
    return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]


def shared_prefix(llm: LLM, reqs) -> dict:
    llm.generate([reqs[0].prompt_token_ids], _params(reqs[:1]), use_tqdm=False)
    outs = llm.generate([r.prompt_token_ids for r in reqs[1:]], _params(reqs[1:]), use_tqdm=False)
    return {"median_ttft_s": statistics.median(o.metrics.time_to_first_token for o in outs),
            "mean_cached_tokens": statistics.mean(o.num_cached_tokens for o in outs)}


def policy_run(llm: LLM, reqs) -> dict:
    before = llm.stats()["preemptions"]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], _params(reqs), use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return {"wall_s": wall, "output_tok_s": tokens / wall, "preemptions": llm.stats()["preemptions"] - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args()
    common = dict(dtype=args.dtype, max_model_len=2048, num_threads=args.threads)

    engines = {"cache_on": LLM(args.model, enable_prefix_caching=True, **common),
               "cache_off": LLM(args.model, enable_prefix_caching=False, **common)}
    hf = engines["cache_on"].tokenizer.hf
    vocab = vocabulary(len(hf), set(hf.added_tokens_decoder) | set(hf.all_special_ids))
    w1 = build_requests(WORKLOADS["W1"], vocab, seed=0)
    per_block = engines["cache_on"].model_info.kv_block_bytes
    need = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in w1)
    quarter = need // 4 * per_block
    for name in ("max_utilization", "guaranteed_no_evict"):
        engines[name] = LLM(args.model, kv_cache_memory=quarter, scheduling_policy=name, **common)

    runs: dict[str, list[dict]] = {k: [] for k in engines}
    for i in range(args.repeats):
        order = list(engines)[i % len(engines):] + list(engines)[:i % len(engines)]  # rotate: no fixed position
        for name in order:
            llm = engines[name]
            if name.startswith("cache"):  # another system prompt each repeat: the cache starts cold
                runs[name].append(shared_prefix(llm, build_requests(WORKLOADS["W2"], vocab, seed=i)))
            else:
                runs[name].append(policy_run(llm, w1))
            print(name, runs[name][-1], flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    record = {
        "model": args.model or "SmolLM2-135M-Instruct (default)", "dtype": args.dtype, "repeats": args.repeats,
        "pool_blocks_quarter": need // 4, "w1_blocks_needed": need, "runs": runs, "medians": med,
        "ttft_ratio_off_over_on": med["cache_off"]["median_ttft_s"] / med["cache_on"]["median_ttft_s"],
    }
    print(json.dumps(record["medians"], indent=1), "\nTTFT off/on:", round(record["ttft_ratio_off_over_on"], 2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
