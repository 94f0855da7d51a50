"""Owns the model and the KV cache tensors; turns a scheduled batch into one flat forward pass and samples.

Input preparation is plain Python lists turned into tensors once per step: token ids, positions, slot of every
token, and the attention metadata (decode rows first, then prefill spans).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember.config import EngineConfig
from ember.core.block_manager import SWAP_OUT
from ember.core.memory import (MEM_RATIO_ENV, PeakMemory, fit_hint, host_tier_bytes, kv_pool_budget, memory_now,
                               reset_peak)
from ember.core.scheduler import ScheduledBatch
from ember.core.sequence import Sequence
from ember.kernels import kernels_for
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.layers.kv_cache import KVCacheFormat
from ember.layers.sampler import Sampler, SamplerOutput
from ember.model_loader import LoadedModel

logger = logging.getLogger("ember")
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError from 2.5


@dataclass(slots=True)
class StepOutput:
    sampled: list[Sequence]  # sequences that produced a token this step
    sampler: SamplerOutput | None
    # seq_id -> (log_softmax rows, the prompt tokens they predict, position of the chunk's first token)
    prompt_logprobs: dict[int, tuple[torch.Tensor, list[int], int]]


def kv_format(loaded: LoadedModel, kv_cache_dtype: str = "auto") -> KVCacheFormat:
    cfg = loaded.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVCacheFormat(kv_cache_dtype, head_dim, loaded.dtype)


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    cfg = loaded.hf_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    entry = kv_format(loaded, kv_cache_dtype).bytes_per_entry()
    return 2 * cfg.num_hidden_layers * block_size * heads * entry


class ModelRunner:
    """Start-up (in order): build the kernels; measure a step's peak activation memory with a dummy forward at the
    per-step token budget; size the KV pool from what is left of the budget and check that it holds a sequence of
    max_model_len; warm up at the worst case: a decode step of max_num_seqs sequences x max_model_len of context and a
    full-budget prefill. After that, serving allocates nothing the warm-up did not (``memory_report``)."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.model = loaded.model
        self.device = torch.device(config.device)
        self.block_size = bs = config.block_size
        self.max_model_len = max_model_len
        self.sampler = Sampler(loaded.hf_config.vocab_size)
        kernels_for(self.device)  # compile (first run on this machine) or load the CPU kernels now, not mid-step
        self._layers = self.model.attention_layers()
        self.kv_format = fmt = kv_format(loaded, config.kv_cache_dtype)
        for layer in self._layers:
            layer.kv_format = fmt
        first = self._layers[0]
        self._kv_shape = (len(self._layers), bs, first.num_kv_heads, fmt.entry)
        self._dtype = fmt.pool_dtype
        per_block = kv_bytes_per_block(loaded, bs, config.kv_cache_dtype)

        # 1. a step's activations, measured on a scratch pool that holds just the dummy prompt
        tokens = min(max_num_batched_tokens, max_model_len)
        self._bind(self._new_pool(-(-tokens // bs)))
        with PeakMemory(self.device) as act:
            self._dummy_prefill(tokens, config.max_num_seqs)
        self.activation_bytes = act.bytes
        self._bind(None)

        # 2. the pool: what the budget leaves, never more than every seat at full length needs
        budget = kv_pool_budget(config, self.device, self.activation_bytes)
        blocks_per_seq = -(-max_model_len // bs)
        self.num_blocks = min(max(budget.bytes, 0) // per_block, blocks_per_seq * config.max_num_seqs)
        if self.num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool cannot hold one sequence of max_model_len={max_model_len}: {budget.source} leaves "
                f"{max(budget.bytes, 0) / 2**20:.1f} MiB = {self.num_blocks * bs} tokens of KV "
                f"({per_block // bs} bytes a token); "
                f"{fit_hint(self.num_blocks * bs, max_model_len, config.max_num_seqs)}; or raise the memory "
                f"(kv_cache_memory, kv_cache_memory_fraction or {MEM_RATIO_ENV})")
        self.kv_cache = self._new_pool(self.num_blocks)
        self._bind(self.kv_cache)
        self.budget_source = budget.source

        # 3. the host tier (CUDA): evicted prefix blocks wait there
        self.num_host_blocks = host_tier_bytes(config, self.device) // per_block
        self.host_cache = None
        if self.num_host_blocks:  # pinned on CUDA: the copies to and from the device run asynchronously
            self.host_cache = self._new_pool(self.num_host_blocks, torch.device("cpu"),
                                             pin=self.device.type == "cuda")

        # 4. warm-up at the worst case: every seat decoding at max_model_len (block tables may repeat blocks:
        # the shapes and the memory are what is proved, not the values)
        try:
            with PeakMemory(self.device) as warm:
                self._dummy_decode(config.max_num_seqs, max_model_len)
                self._dummy_prefill(tokens, config.max_num_seqs)  # and a full-budget prefill next to the real pool
        except _OOM as e:
            raise ValueError(
                f"the warm-up (max_num_seqs={config.max_num_seqs} x max_model_len={max_model_len}, and {tokens} "
                f"prefill tokens a step) ran out of memory next to a KV pool of {self.num_blocks * bs} "
                f"tokens; {fit_hint(self.num_blocks * bs, max_model_len, config.max_num_seqs)}; or lower "
                f"max_num_batched_tokens or the memory fraction") from e
        self.kv_cache.zero_()  # the dummy steps wrote finite garbage; padded decode reads must see zeros
        self.warmup_peak_bytes = warm.peak
        self.warmup_transient_bytes = warm.bytes
        reset_peak(self.device)  # from here the peak is what serving needs: compare with warmup_peak_bytes
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) from %s; %d host blocks; warm-up peak %.0f MiB",
                    self.num_blocks, bs, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
                    budget.source, self.num_host_blocks, warm.peak / 2**20)

    def _new_pool(self, num_blocks: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
        # zeros, not empty: padded decode batches read unused slots, and NaN garbage there would survive the mask
        return torch.zeros(2, self._kv_shape[0], num_blocks, *self._kv_shape[1:], dtype=self._dtype,
                           device=device or self.device, pin_memory=pin)

    def _bind(self, pool: torch.Tensor | None) -> None:
        for i, layer in enumerate(self._layers):
            layer.k_cache, layer.v_cache = (pool[0, i], pool[1, i]) if pool is not None else (torch.empty(0),) * 2

    @torch.inference_mode()
    def _dummy_prefill(self, tokens: int, sample_rows: int) -> None:
        """One prompt of `tokens` tokens from position 0, then logits and log-softmax for sample_rows rows."""
        dev = self.device
        pool_blocks = self._layers[0].k_cache.shape[0]
        table = torch.arange(-(-tokens // self.block_size), device=dev) % pool_blocks
        slots = (table.repeat_interleave(self.block_size)[:tokens] * self.block_size
                 + torch.arange(tokens, device=dev) % self.block_size)
        meta = AttentionMetadata(slots, 0, None, None, [PrefillSpan(0, tokens, tokens, table)])
        positions = torch.arange(tokens, device=dev)
        hidden = self.model(torch.zeros(tokens, dtype=torch.long, device=dev), positions, meta)
        rows = torch.arange(sample_rows, device=dev) % tokens
        self.model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)

    @torch.inference_mode()
    def _dummy_decode(self, num_seqs: int, context: int) -> None:
        """num_seqs sequences each decoding at position context - 1, their tables cycling over the pool."""
        dev, bs = self.device, self.block_size
        pool_blocks = self._layers[0].k_cache.shape[0]
        width = -(-context // bs)
        tables = (torch.arange(num_seqs * width, device=dev) % pool_blocks).view(num_seqs, width)
        last = (context - 1) // bs
        slots = tables[:, last] * bs + (context - 1) % bs
        lens = torch.full((num_seqs,), context, dtype=torch.long, device=dev)
        meta = AttentionMetadata(slots, num_seqs, tables, lens, [])
        positions = torch.full((num_seqs,), context - 1, dtype=torch.long, device=dev)
        hidden = self.model(torch.zeros(num_seqs, dtype=torch.long, device=dev), positions, meta)
        self.model.compute_logits(hidden).float().log_softmax(dim=-1)

    def copy_blocks(self, copies: list[tuple[str, int, int]]) -> None:
        """Run the host-tier copies queued by the block manager, in order (runs of one direction together)."""
        i = 0
        while i < len(copies):
            j = i
            while j < len(copies) and copies[j][0] == copies[i][0]:
                j += 1
            src = torch.tensor([c[1] for c in copies[i:j]], dtype=torch.long)
            dst = torch.tensor([c[2] for c in copies[i:j]], dtype=torch.long)
            if copies[i][0] == SWAP_OUT:
                blocks = self.kv_cache.index_select(2, src.to(self.device)).to("cpu")
                self.host_cache.index_copy_(2, dst, blocks)
            else:
                blocks = self.host_cache.index_select(2, src).to(self.device, non_blocking=True)
                self.kv_cache.index_copy_(2, dst.to(self.device), blocks)
            i = j

    def memory_report(self) -> dict[str, int]:
        """Memory now and the peak since warm-up, next to the warm-up's peak (CUDA: allocator; CPU: RSS)."""
        now, peak = memory_now(self.device)
        return {"memory_in_use_bytes": now, "serving_peak_bytes": peak, "warmup_peak_bytes": self.warmup_peak_bytes,
                "activation_bytes": self.activation_bytes,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size()}

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence],
                                                       list[int], dict[int, tuple[int, list[int], int]]]:
        order = sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1)  # decodes first
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, tuple[int, list[int], int]] = {}
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start, c = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(c + 1)
            else:
                prefills.append(PrefillSpan(start, n, c + n, torch.tensor(table, dtype=torch.long, device=self.device)))
            if c + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(start + n - 1)
            if seq.index == 0 and seq.request.wants_prompt_logprobs and c < seq.num_prompt_tokens:
                # rows at positions c..end-1 predict prompt tokens c+1..end
                end = min(c + n, seq.num_prompt_tokens - 1)
                prompt_rows[seq.seq_id] = (start, seq.token_ids[c + 1:end + 1], c)
        dev = self.device
        nd = len(decode_tables)
        tables_t = lens_t = None
        if nd:
            width = max(len(t) for t in decode_tables)
            tables_t = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
            lens_t = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), nd, tables_t, lens_t, prefills)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_seqs, sample_rows, prompt_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        if batch.copies:
            self.copy_blocks(batch.copies)
        ids, positions, meta, sample_seqs, sample_rows, prompt_rows = self._prepare(batch)
        hidden = self.model(ids, positions, meta)
        sampled = None
        if sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            sampled = self.sampler(logits, sample_seqs)
        prompt_lps = {}
        for seq_id, (start, targets, first) in prompt_rows.items():
            logprobs = self.model.compute_logits(hidden[start:start + len(targets)]).log_softmax(dim=-1)
            prompt_lps[seq_id] = (logprobs, targets, first)
        return StepOutput(sample_seqs, sampled, prompt_lps)
