"""The engine core over ``ember.executor.scripted.ScriptedExecutor``, built without a model, and helpers to run it
and read its outputs (``tests/unit/core``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ember.config import LoRAConfig, SpeculativeConfig
from ember.core.engine_core import EngineCore
from ember.executor.scripted import EOS, ScriptedExecutor, default_script, scripted_configs
from ember.frontend.parallel_sampling import fan_out
from ember.lora.request import LoRARequest
from ember.protocol import EngineOutput, EngineRequest, SamplingRow
from ember.sampling_params import SamplingParams

__all__ = ["EOS", "ScriptedExecutor", "add", "default_script", "make_core", "request", "request_samples", "run",
           "samples"]


def make_core(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8, max_model_len: int = 256,
              max_num_batched_tokens: int = 256, chunked_prefill: bool = True, prefix_caching: bool = True,
              policy: str = "max_utilization", script: Callable[[SamplingRow], int] = default_script,
              speculative: SpeculativeConfig | None = None, max_loras: int = 0,
              num_host_blocks: int = 0) -> EngineCore:
    """An engine core over a ``ScriptedExecutor`` (``core.executor``) with these limits; max_loras > 0: that many
    adapter slots (the scripted worker loads nothing); num_host_blocks: a host tier for evicted prefix blocks."""
    sched, resolved = scripted_configs(max_num_seqs, max_model_len, max_num_batched_tokens, block_size,
                                       chunked_prefill, prefix_caching, policy)
    model = dataclasses.replace(resolved.model, lora=LoRAConfig(max_loras, 8)) if max_loras else resolved.model
    resolved = dataclasses.replace(resolved, speculative=speculative, model=model)
    return EngineCore(ScriptedExecutor(num_blocks, block_size, num_host_blocks, script), sched, resolved)


def request(request_id: str, prompt: list[int], max_model_len: int = 256, lora_id: int = 0,
            **params: Any) -> EngineRequest:
    """A request as the front end would hand it over: parameters validated, EOS filled in; lora_id > 0: it runs with
    that adapter (salted as the front end salts it)."""
    sp = SamplingParams(**params)
    sp.eos_token_ids = (EOS,)
    lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return EngineRequest(request_id, list(prompt), sp, min(len(prompt) + sp.max_tokens, max_model_len),
                         cache_salt=f"lora-{lora_id}" if lora_id else None, lora=lora)


def add(core: EngineCore, record: EngineRequest) -> list[str]:
    """Queue a request as the front end does (n > 1 fanned out to one core request a sample); the core's ids, sample
    i's first."""
    records = fan_out(record)
    for r in records:
        core.add(r)
    return [r.request_id for r in records]


def run(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[EngineOutput]]:
    """Step until the core has no work; every output, by request."""
    seen: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return seen
        for out in core.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"the core still had work after {max_steps} steps")


def samples(outputs: list[EngineOutput]) -> dict[int, tuple[list[int], list[Any]]]:
    """A request's outputs joined: sample index -> (tokens, finish reasons seen, in order)."""
    joined: dict[int, tuple[list[int], list[Any]]] = {}
    for out in outputs:
        for s in out.samples:
            tokens, reasons = joined.setdefault(s.index, ([], []))
            tokens.extend(s.new_token_ids)
            if s.finish_reason is not None:
                reasons.append(s.finish_reason)
    return joined


def request_samples(seen: dict[str, list[EngineOutput]], core_ids: list[str]) -> dict[int, tuple[list[int], list[Any]]]:
    """A fanned-out request's samples joined from its core requests' outputs (``add``'s ids): index -> (tokens,
    finish reasons seen); a beam search or a single sample is one core request with its own indexes."""
    if len(core_ids) == 1:
        return samples(seen.get(core_ids[0], []))
    return {i: samples(seen.get(cid, [])).get(0, ([], [])) for i, cid in enumerate(core_ids)}
