"""A worker's start-up, in order: measure a step's peak activation memory with a dummy forward at the per-step
token budget (in prompts of max_model_len, or shorter ones where attention memory is linear in tokens); size the
KV pool from what is left of the budget and check that it holds a sequence of max_model_len; add the host tier;
warm up at the worst case: a decode step of max_num_seqs sequences x max_model_len of context and (CUDA) a
full-budget prefill next to the pool; on CUDA, capture the decode step's graphs. After that, serving allocates
nothing the warm-up did not (``Worker.stats``)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from ember import envs
from ember.config import CacheConfig, SchedulerConfig
from ember.errors import ConfigError, DoesNotFitError
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.layers.kv_cache import KVCacheFormat
from ember.model_loader import LoadedModel, prepared
from ember.protocol import PoolPlan
from ember.worker.memory import PeakMemory, fit_hint, host_tier_bytes, kv_pool_budget, reset_peak

logger = logging.getLogger("ember")
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError from 2.5


def kv_format(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> KVCacheFormat:
    return KVCacheFormat(kv_cache_dtype, loaded.shape.head_dim, loaded.dtype)


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block on this rank: its stage's layers, its KV heads."""
    entry = kv_format(loaded, kv_cache_dtype).bytes_per_entry()
    return 2 * loaded.local_layers * block_size * loaded.local_kv_heads * entry


class Runner(Protocol):
    """What start-up uses of a worker: its model, layers and device, pools to make and bind, the ranks' minimum."""

    device: torch.device
    loaded: LoadedModel
    model: Any
    layers: list[Any]
    block_size: int

    def new_pool(self, num_blocks: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor: ...

    def draft_bytes_per_block(self) -> int: ...

    def bind(self, pool: torch.Tensor | None) -> None: ...

    def agree_min(self, value: int) -> int: ...

    def forward_stage(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Any: ...

    def capture_graphs(self, max_num_seqs: int, max_len: int) -> None: ...


def plan_num_blocks(budget_bytes: int, bytes_per_block: int, block_size: int, max_len: int, seats: int,
                    max_tokens: int | None = None) -> int:
    """The KV pool's blocks: what the budget holds, never more than every seat at full length needs (nor more than
    ``max_tokens`` of KV when that is set)."""
    blocks_per_seq = -(-max_len // block_size)
    most = blocks_per_seq * seats
    if max_tokens is not None:
        most = min(most, -(-max_tokens // block_size))
    return min(max(budget_bytes, 0) // bytes_per_block, most)


def start(worker: Runner, cache: CacheConfig, sched: SchedulerConfig) -> tuple[PoolPlan, torch.Tensor,
                                                                               torch.Tensor | None]:
    """Measure a step's activations, size and allocate the KV pool (and the host tier), warm up at the worst case,
    capture the CUDA graphs. Returns the plan, the pool (bound to the layers) and the host tier's pool, if any."""
    bs, max_len, seats = cache.block_size, sched.max_model_len, sched.max_num_seqs
    if cache.attention_window is not None:
        if any(layer.sliding_window for layer in worker.layers):
            raise ConfigError("attention_window (StreamingLLM) is not supported on a model with "
                              "sliding-window layers: they already bound their attention; leave it None")
        max_len = min(max_len, cache.attention_window)  # a sequence never holds more KV than its window
    # a draft model's pool has the same blocks: each block costs both
    own_block = kv_bytes_per_block(worker.loaded, bs, cache.kv_cache_dtype)
    per_block = own_block + worker.draft_bytes_per_block()

    # 1. a step's activations, measured on a scratch pool that holds just the dummy prompts: the step's budget
    # (or what every seat can take), in prompts of max_model_len, or short ones where that measures the same
    tokens = min(sched.max_num_batched_tokens, seats * max_len)
    longest = min(tokens, max_len)  # the longest prompt a step holds
    prompt = measuring_prompt_len(worker, longest)
    act_bytes = measured_activations(worker, tokens, seats, prompt, cache.kv_cache_dtype)
    act_bytes += long_prompt_bytes(worker, longest, prompt)

    # 2. the pool: what the budget leaves, never more than every seat at full length needs
    budget = kv_pool_budget(cache, worker.device, act_bytes)
    # split over ranks, every rank holds the same block numbers: the smallest pool decides
    num_blocks = worker.agree_min(plan_num_blocks(budget.bytes, per_block, bs, max_len, seats, cache.max_tokens))
    if num_blocks < -(-max_len // bs):
        raise DoesNotFitError(
            f"the KV pool cannot hold one sequence of max_model_len={max_len}: {budget.source} leaves "
            f"{max(budget.bytes, 0) / 2**20:.1f} MiB = {num_blocks * bs} tokens of KV ({per_block // bs} bytes a "
            f"token); {fit_hint(num_blocks * bs, max_len, seats)}; or raise the memory (kv_cache_memory, "
            f"kv_cache_memory_fraction or {envs.MEM_RATIO})")
    kv_cache = worker.new_pool(num_blocks)
    worker.bind(kv_cache)

    # 3. the host tier (CUDA): evicted prefix blocks wait there
    num_host = worker.agree_min(host_tier_bytes(cache, worker.device) // own_block)  # the target's blocks
    host_cache = None
    if num_host:  # pinned on CUDA: the copies to and from the device run asynchronously
        host_cache = worker.new_pool(num_host, torch.device("cpu"), pin=worker.device.type == "cuda")

    # 4. warm-up at the worst case: every seat decoding at max_model_len (block tables may repeat blocks:
    # the shapes and the memory are what is proved, not the values)
    cuda = worker.device.type == "cuda"
    try:
        with PeakMemory(worker.device) as warm:
            dummy_decode(worker, seats, max_len)
            if cuda:  # and a full-budget prefill next to the real pool: the caching allocator's blocks must fit
                dummy_prefill(worker, tokens, seats, prompt)
    except _OOM as e:
        raise DoesNotFitError(
            f"the warm-up (max_num_seqs={seats} x max_model_len={max_len}, and {tokens} prefill tokens a step) ran "
            f"out of memory next to a KV pool of {num_blocks * bs} tokens; {fit_hint(num_blocks * bs, max_len, seats)}"
            "; or lower max_num_batched_tokens or the memory fraction") from e
    # CPU: the heap has no cache to fit, a prefill's activations come and go: its peak next to the pool is the
    # pool's RSS plus the activations step 1 measured, so a second full-budget prefill would prove nothing more
    peak = warm.peak if cuda else max(warm.peak, warm.start + act_bytes)
    kv_cache.zero_()  # the dummy steps wrote finite garbage; padded decode reads must see zeros
    worker.capture_graphs(seats, max_len)  # CUDA: decode graphs (their inputs touch no pool entry)
    reset_peak(worker.device)  # from here the peak is what serving needs: compare with warmup_peak_bytes
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) from %s; %d host blocks; warm-up peak %.0f MiB",
                num_blocks, bs, kv_cache.numel() * kv_cache.element_size() / 2**20, budget.source, num_host,
                peak / 2**20)
    return PoolPlan(num_blocks, num_host, bs, act_bytes, budget.source, peak), kv_cache, host_cache


def encoder_plan(cache: CacheConfig, sched: SchedulerConfig) -> PoolPlan:
    """An encoder's plan: no pool (it keeps no KV); its blocks are only the scheduler's count of what a step
    admits, as many as every seat at max_model_len needs."""
    bs = cache.block_size
    num_blocks = -(-sched.max_model_len // bs) * sched.max_num_seqs
    return PoolPlan(num_blocks, 0, bs, 0, "encoder: no KV cache", 0)


def measured_activations(worker: Runner, tokens: int, seats: int, prompt: int, kv_cache_dtype: str) -> int:
    """A step's activation bytes: a dummy prefill of `tokens` in prompts of `prompt` on a scratch pool, measured;
    or what an earlier start measured of the same prepared model at the same shape (``prepared``, CPU only: the
    model, the code and the machine are the same, so the measure is too)."""
    key = worker.loaded.prepared_key
    probe = (f"tokens={tokens} prompt={prompt} rows={seats} block={worker.block_size} kv={kv_cache_dtype} "
             f"lora={getattr(worker, 'lora', None)}")
    if (cached := prepared.activation_bytes(key, probe)) is not None:
        return cached
    worker.bind(worker.new_pool(-(-tokens // worker.block_size)))
    with PeakMemory(worker.device) as act:
        dummy_prefill(worker, tokens, seats, prompt)
    worker.bind(None)
    prepared.record_activation_bytes(key, probe, act.bytes)
    return act.bytes


MEASURING_PROMPT = 256  # tokens a dummy prompt where every layer's prefill memory is linear in its tokens


def measuring_prompt_len(worker: Runner, longest: int) -> int:
    """The dummy prompts' length: the longest a step can hold where a layer's attention memory grows faster than
    its tokens (SDPA's scores), else MEASURING_PROMPT tokens: the same rows through every other layer, and at 2,048
    tokens an eighth of one long prompt's attention work."""
    dtype = worker.loaded.dtype
    if all(layer.backend is not None and layer.backend.prefill_memory_is_linear(layer, dtype)
           for layer in worker.layers):
        return min(longest, MEASURING_PROMPT)
    return longest


def long_prompt_bytes(worker: Runner, longest: int, prompt: int) -> int:
    """What a prompt of `longest` tokens holds beyond the measured prompts of `prompt` tokens, where attention
    memory is linear: a layer's attention output for the whole prompt next to the step's (and the kernel's int64
    lengths)."""
    layer = worker.layers[0]
    return max(longest - prompt, 0) * (layer.num_heads * layer.head_dim * worker.loaded.dtype.itemsize + 8)


@torch.inference_mode()
def dummy_prefill(worker: Runner, tokens: int, sample_rows: int, prompt: int | None = None) -> None:
    """Prompts of `prompt` tokens (default: one of all `tokens`) from position 0, `tokens` in all, then logits and
    log-softmax for sample_rows rows."""
    dev, bs = worker.device, worker.block_size
    pool_blocks = worker.layers[0].k_cache.shape[0]
    prompt = prompt or tokens
    spans, slots, positions = [], [], []
    for start in range(0, tokens, prompt):
        n = min(prompt, tokens - start)
        table = (torch.arange(-(-n // bs), device=dev) + start // bs) % pool_blocks
        slots.append(table.repeat_interleave(bs)[:n] * bs + torch.arange(n, device=dev) % bs)
        positions.append(torch.arange(n, device=dev))
        spans.append(PrefillSpan(start, n, n, table))
    meta = AttentionMetadata(torch.cat(slots), 0, None, None, spans)
    hidden = worker.forward_stage(torch.zeros(tokens, dtype=torch.long, device=dev), torch.cat(positions), meta)
    if hidden is not None:
        rows = torch.arange(sample_rows, device=dev) % tokens
        logits = worker.model.compute_logits(hidden[rows])
        if logits is not None:
            logits.float().log_softmax(dim=-1)


@torch.inference_mode()
def dummy_decode(worker: Runner, num_seqs: int, context: int) -> None:
    """num_seqs sequences each decoding at position context - 1, their tables cycling over the pool."""
    dev, bs = worker.device, worker.block_size
    pool_blocks = worker.layers[0].k_cache.shape[0]
    width = -(-context // bs)
    tables = (torch.arange(num_seqs * width, device=dev) % pool_blocks).view(num_seqs, width)
    last = (context - 1) // bs
    slots = tables[:, last] * bs + (context - 1) % bs
    lens = torch.full((num_seqs,), context, dtype=torch.long, device=dev)
    meta = AttentionMetadata(slots, num_seqs, tables, lens, [])
    positions = torch.full((num_seqs,), context - 1, dtype=torch.long, device=dev)
    hidden = worker.forward_stage(torch.zeros(num_seqs, dtype=torch.long, device=dev), positions, meta)
    if hidden is not None:
        logits = worker.model.compute_logits(hidden)
        if logits is not None:
            logits.float().log_softmax(dim=-1)
