"""Time to first token on a shared-prefix workload, prefix caching on against off (same process, same prompts).

64 requests: one 384-token system prompt plus a 16-64-token suffix each, 64 output tokens. Request 1 runs alone
and warms the cache; requests 2..N arrive together. Reports the median TTFT of requests 2..N and the ratio.

    python benchmarks/shared_prefix_ttft.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()

    from ember import LLM, SamplingParams

    results = {}
    for caching in (False, True):
        llm = LLM(dtype=args.dtype, max_model_len=2048, enable_prefix_caching=caching)
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        system = torch.randint(100, vocab, (384,), generator=g).tolist()
        prompts = [system + torch.randint(100, vocab, (int(torch.randint(16, 65, (1,), generator=g)),),
                                          generator=g).tolist() for _ in range(args.requests)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:1], params, use_tqdm=False)
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        results["on" if caching else "off"] = {
            "median_ttft_s": statistics.median(o.metrics.time_to_first_token for o in outs),
            "mean_cached_tokens": statistics.mean(o.num_cached_tokens for o in outs),
        }
        llm.shutdown()
    results["ttft_ratio_off_over_on"] = results["off"]["median_ttft_s"] / results["on"]["median_ttft_s"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
