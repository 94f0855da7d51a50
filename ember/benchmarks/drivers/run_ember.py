"""ember's own driver: the native ``LLM`` (throughput, latency) and ``AsyncLLM`` (serving)."""

from __future__ import annotations

import asyncio
import time

from _common import TokenClock, output_record, package_versions, poisson_arrivals, run, set_threads, warmup_requests


def load(spec: dict):
    set_threads(spec.get("threads"))
    from ember import LLM, AsyncLLM

    cls = AsyncLLM if spec["mode"] == "serving" else LLM
    opts = dict(spec.get("options", {}))
    global _GUIDE, _LORAS, _PREDICT
    _GUIDE = opts.pop("guided_json", None)  # a sampling setting of the ember-json variant, not an engine argument
    _PREDICT = bool(opts.pop("predictions", False))  # ember-prediction: requests send their predicted answers
    adapters = int(opts.pop("lora_adapters", 0))  # the ember-lora variant's adapters, made here
    if adapters:
        _LORAS = random_adapters(spec["model"], adapters, LORA_RANK)
        opts.update(enable_lora=True, max_loras=adapters, max_lora_rank=LORA_RANK)
    llm = cls(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              num_threads=spec.get("threads"), device=spec.get("device", "auto"), **opts)
    if spec["mode"] != "serving":
        throughput(llm, {"requests": warmup_requests(spec)})
    return llm


def _split(llm) -> bool:
    info = llm.model_info
    return info.tensor_parallel_size * info.pipeline_parallel_size > 1


def rank_figures(llm, wall: float) -> dict:
    """A split model's ranks over the timed run: the share of the wall time each spent inside collectives
    (all-reduce, vocabulary gather, sends; waiting for slower peers included) and waiting for its input (a later
    stage) or for the sampled tokens (rank 0), and what it holds."""
    out = {}
    for r in llm.client.rank_reports(reset=True):
        inside = sum(r.get(k, 0.0) for k in ("all_reduce_s", "gather_s", "send_s"))
        waiting = r.get("recv_s", 0.0) + r.get("result_wait_s", 0.0)
        out[f"rank{r['rank']}"] = {"collectives_share": inside / wall, "waiting_share": waiting / wall,
                                   "weight_mib": r["weight_bytes"] / 2**20, "kv_cache_mib": r["kv_cache_bytes"] / 2**20,
                                   "layers": r["layers"], "kv_heads": r["kv_heads"]}
    return out


_GUIDE: dict | None = None
_PREDICT = False
_LORAS: list = []  # the ember-lora variant's LoRARequests; request i runs with _LORAS[i % len(_LORAS)]
LORA_RANK = 16  # vLLM's default max_lora_rank


def random_adapters(model: str, n: int, rank: int) -> list:
    """n PEFT-shaped adapters of rank ``rank`` on all seven projections, random (A ~ N(0, 1/in), B small), written
    to a temporary folder: LoRA's cost without depending on peft or a download."""
    import json
    import os
    import tempfile

    import torch
    from safetensors.torch import save_file

    from ember import LoRARequest
    from ember.lora.adapter import module_name, projection_shapes
    from ember.model_loader import read_shape

    shape = read_shape(model)
    folder = tempfile.mkdtemp(prefix="ember-bench-lora-")
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(n):
        tensors = {}
        for layer in range(shape.num_layers):
            for proj, (n_in, n_out) in projection_shapes(shape).items():
                key = f"base_model.model.{module_name(layer, proj)}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 1e-3
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(projection_shapes(shape))}, f)
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    return requests


def _loras(n: int) -> list | None:
    return [_LORAS[i % len(_LORAS)] for i in range(n)] if _LORAS else None


def _params(r: dict):
    from ember import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=not r.get("stop_at_eos"),
                          structured_outputs={"json": _GUIDE} if _GUIDE else None)


def _guided_figures(llm) -> dict:
    """Mask work of the run (structured output): seconds computing masks, seconds steps waited for them, per step."""
    s = llm.client.stats()
    steps = max(1, s["guided_steps"])
    return {"mask_ms_per_step": 1e3 * s["guided_mask_seconds"] / steps,
            "mask_wait_ms_per_step": 1e3 * s["guided_mask_wait_seconds"] / steps, "guided_steps": s["guided_steps"]}


def throughput(llm, spec: dict) -> dict:
    reqs = spec["requests"]
    if _split(llm):
        llm.client.rank_reports(reset=True)  # count the timed run only
    start = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in reqs], [_params(r) for r in reqs], use_tqdm=False,
                        lora_request=_loras(len(reqs)))
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "outputs": [output_record(len(r["prompt_token_ids"]), len(o.outputs[0].token_ids))
                                          for r, o in zip(reqs, outs)]}
    if _split(llm):
        result["ranks"] = rank_figures(llm, wall)
    if _GUIDE:
        result["guided"] = _guided_figures(llm)
    return result


def _prompt(r: dict):
    """The request's prompt: its token ids, with its prediction where it has one and the variant sends them."""
    if _PREDICT and r.get("prediction_token_ids"):
        return {"prompt_token_ids": r["prompt_token_ids"], "prediction_token_ids": r["prediction_token_ids"]}
    return r["prompt_token_ids"]


def latency(llm, spec: dict) -> dict:
    outputs, start = [], time.perf_counter()
    for r in spec["requests"]:
        clock, metrics = TokenClock(), None
        for delta in llm.stream(_prompt(r), _params(r)):
            clock.tick(len(delta.outputs[0].token_ids))
            metrics = delta.metrics
        record = output_record(len(r["prompt_token_ids"]), len(clock.times), clock.times)
        if metrics is not None and metrics.num_draft_tokens:  # speculative decoding: drafted and kept tokens
            record.update(draft_tokens=metrics.num_draft_tokens,
                          accepted_draft_tokens=metrics.num_accepted_draft_tokens)
        outputs.append(record)
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}


def serving(llm, spec: dict) -> dict:
    """Poisson arrivals at ``rate`` requests/s (inf: all at once), at most ``concurrency`` in flight."""
    opts = spec["serving"]
    gate = asyncio.Semaphore(int(opts["concurrency"]))  # binds to asyncio.run's loop at first use (3.10+)

    async def one(r: dict) -> dict:
        async with gate:
            clock = TokenClock()
            async for delta in llm.generate(r["prompt_token_ids"], _params(r).clone(output_kind=_delta())):
                clock.tick(len(delta.outputs[0].token_ids))
        return output_record(len(r["prompt_token_ids"]), len(clock.times), clock.times) | {"start_s": clock.start}

    async def main() -> dict:
        await _warm(llm, spec)
        return await poisson_arrivals(spec["requests"], one, float(opts["rate"]), opts.get("seed", 0))

    result = asyncio.run(main())
    llm.shutdown()
    return result


def _delta():
    from ember.sampling_params import OutputKind

    return OutputKind.DELTA


async def _warm(llm, spec: dict) -> None:
    for r in warmup_requests(spec):
        async for _ in llm.generate(r["prompt_token_ids"], _params(r)):
            pass



if __name__ == "__main__":
    run(load, {"throughput": throughput, "latency": latency, "serving": serving}, package_versions("ember"))
