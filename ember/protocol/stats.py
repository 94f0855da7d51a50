"""Engine counters as typed records: the core's (scheduler, KV blocks, prefix cache, structured output, LoRA) and
what the driver rank reports of itself (memory, backend). ``EngineStats.as_dict`` is the flat dict that
``LLM.stats()`` and the server's /metrics have always shown."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    scheduling_policy: str
    kv_blocks_total: int
    kv_blocks_free: int
    kv_cache_usage: float  # used blocks / total
    running: int
    waiting: int
    preempted_waiting: int  # preempted sequences waiting to be recomputed
    preemptions: int
    interrupted: int
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_host_hit_tokens: int
    prefix_cache_ttl: float | None
    prefix_cache_expired_blocks: int
    host_tier: str  # "off", "off (CPU engine: ...)" or "N blocks"
    host_blocks_cached: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    guided_steps: int
    guided_rows: int
    guided_mask_seconds: float
    guided_mask_wait_seconds: float
    lora_slots: tuple[int | None, ...] | None = None  # slot -> adapter id (None: LoRA off)
    lora_swaps: int | None = None
    # speculative decoding (None: off): rows that verified a draft, drafted tokens, kept ones, kept per position
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_accepted_per_position: tuple[int, ...] | None = None
    images_encoded: int | None = None  # a vision-language model's images encoded (a cached one is not again)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Rank 0's own figures: where its KV budget came from, its attention backend, its memory (CUDA: allocator;
    CPU: RSS) now and at peak since warm-up, next to what start-up measured."""

    kv_budget_source: str
    attention_backend: str
    memory_in_use_bytes: int
    serving_peak_bytes: int
    warmup_peak_bytes: int
    activation_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    scheduler: SchedulerStats
    worker: WorkerStats

    def as_dict(self) -> dict[str, object]:
        """One flat dict (the LoRA and speculative decoding keys only when they are on; tuples as lists)."""
        out: dict[str, object] = {}
        for part in (self.scheduler, self.worker):
            for f in fields(part):
                out[f.name] = getattr(part, f.name)
        if out["lora_slots"] is None:
            del out["lora_slots"], out["lora_swaps"]
        else:
            out["lora_slots"] = list(out["lora_slots"])
        if out["images_encoded"] is None:
            del out["images_encoded"]
        if out["spec_decode_num_drafts"] is None:
            for key in [k for k in out if k.startswith("spec_decode_")]:
                del out[key]
        else:
            out["spec_decode_accepted_per_position"] = list(out["spec_decode_accepted_per_position"])
        return out
