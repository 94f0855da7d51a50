"""llama-cpp-python on the very same GGUF file: one request after another (it has no batch scheduler), greedy
(top_k=1), EOS not consulted: ``Llama.generate`` yields tokens until we have the requested count. llama.cpp reuses
the KV of the longest prefix shared with the previous prompt by itself."""

from __future__ import annotations

import time

from _common import TokenClock, output_record, package_versions, run, warmup_requests


def load(spec: dict):
    from llama_cpp import Llama

    opts = dict(spec.get("options", {}))
    llm = Llama(model_path=spec["model"], n_ctx=max(spec["max_model_len"], 512), n_threads=spec.get("threads"),
                n_threads_batch=spec.get("threads"), n_batch=opts.pop("n_batch", 512), seed=0, verbose=False,
                **opts)
    throughput(llm, {"requests": warmup_requests(spec)})
    return llm


def _one(llm, r: dict) -> list[float]:
    clock = TokenClock()
    for _ in llm.generate(r["prompt_token_ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                          reset=True):
        clock.tick()
        if len(clock.times) >= r["max_tokens"]:
            break
    return clock.times


def throughput(llm, spec: dict) -> dict:
    outputs, start = [], time.perf_counter()
    for r in spec["requests"]:
        times = _one(llm, r)
        outputs.append(output_record(len(r["prompt_token_ids"]), len(times)))
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}


def latency(llm, spec: dict) -> dict:
    outputs, start = [], time.perf_counter()
    for r in spec["requests"]:
        llm.reset()  # no prefix reuse between the latency runs: each measures a cold prompt
        times = _one(llm, r)
        outputs.append(output_record(len(r["prompt_token_ids"]), len(times), times))
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}



if __name__ == "__main__":
    run(load, {"throughput": throughput, "latency": latency}, package_versions("llama-cpp-python"))
