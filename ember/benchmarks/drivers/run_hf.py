"""transformers ``generate`` as its users run it for many requests: static batches in arrival order, left padding,
greedy, EOS suppressed (min_new_tokens) so that every row produces the longest request's count. A request's output
tokens are the ones it asked for; the rest of its row is the price of static batching."""

from __future__ import annotations

import time

from _common import TokenClock, output_record, package_versions, run, set_threads, warmup_requests


def load(spec: dict):
    set_threads(spec.get("threads"))
    import torch
    from transformers import AutoModelForCausalLM

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model = model.to(spec.get("device", "cpu")).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    throughput(model, {"requests": warmup_requests(spec), "options": {"batch_size": 2}})
    return model


def _generate(model, batch: list[dict], streamer=None):
    import torch

    width = max(len(r["prompt_token_ids"]) for r in batch)
    pad = model.generation_config.pad_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    ids = torch.tensor([[pad] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
    mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                         for r in batch])
    n = max(r["max_tokens"] for r in batch)
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, streamer=streamer)
    return out.shape[1] - width


def throughput(model, spec: dict) -> dict:
    reqs, size = spec["requests"], int(spec.get("options", {}).get("batch_size", 16))
    outputs, start = [], time.perf_counter()
    for i in range(0, len(reqs), size):
        batch = reqs[i:i + size]
        made = _generate(model, batch)
        outputs += [output_record(len(r["prompt_token_ids"]), min(made, r["max_tokens"])) for r in batch]
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}


class _Clock:
    """A transformers streamer that only records when each new token arrives (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.clock, self.prompt_seen = TokenClock(), False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.clock.tick(value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def latency(model, spec: dict) -> dict:
    outputs, start = [], time.perf_counter()
    for r in spec["requests"]:
        streamer = _Clock()
        _generate(model, [r], streamer)
        times = streamer.clock.times
        outputs.append(output_record(len(r["prompt_token_ids"]), len(times), times))
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}



if __name__ == "__main__":
    run(load, {"throughput": throughput, "latency": latency}, package_versions("transformers", "torch"))
