"""A worker: owns the model, the KV pool and the samples' sampling state, and runs one ``BatchDescription`` per
call into sampled tokens and logprobs. It sees no tokenizer, no request object and no callback: everything it
gets is plain and picklable, which is what lets a worker run in another process or on another rank.
"""

from __future__ import annotations

import torch

from ember.config import CacheConfig, ModelConfig, SchedulerConfig
from ember.kernels import kernels_for
from ember.layers.attention import AttentionMetadata, PrefillSpan, bind_attention_backend
from ember.layers.logits_processors import RowState
from ember.layers.sampler import Sampler, rank_logprobs
from ember.model_loader import load_model
from ember.worker import startup
from ember.worker.batch import SWAP_OUT, BatchDescription, WorkerOutput
from ember.worker.memory import memory_now


class Worker:
    def __init__(self, model_config: ModelConfig, cache: CacheConfig) -> None:
        if model_config.num_threads is not None:
            torch.set_num_threads(model_config.num_threads)
        torch.manual_seed(model_config.seed)
        self.cache_config = cache
        self.loaded = load_model(model_config)
        self.model = self.loaded.model
        self.device = torch.device(model_config.device)
        self.block_size = cache.block_size
        self.sampler = Sampler(self.loaded.shape.vocab_size)
        self.states: dict[int, RowState] = {}  # sample handle -> its sampling state, until released
        self.layers = self.model.attention_layers()
        self.kv_format = fmt = startup.kv_format(self.loaded, cache.kv_cache_dtype)
        for layer in self.layers:
            layer.kv_format = fmt
        first = self.layers[0]
        self._kv_shape = (len(self.layers), cache.block_size, first.num_kv_heads, fmt.entry)
        kernels_for(self.device)  # compile (first run on this machine) or load the CPU kernels now, not mid-step
        self.attention_backend = bind_attention_backend(self.layers, self.device, fmt)
        self.kv_cache = torch.empty(0)
        self.host_cache: torch.Tensor | None = None
        self.plan: startup.PoolPlan | None = None

    def init_cache(self, sched: SchedulerConfig) -> startup.PoolPlan:
        """Measure, size and allocate the KV pool (and host tier), then warm up; see ``startup``."""
        self.plan = startup.start(self, self.cache_config, sched)
        return self.plan

    def new_pool(self, num_blocks: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
        # zeros, not empty: padded decode batches read unused slots, and NaN garbage there would survive the mask
        return torch.zeros(2, self._kv_shape[0], num_blocks, *self._kv_shape[1:], dtype=self.kv_format.pool_dtype,
                           device=device or self.device, pin_memory=pin)

    def bind(self, pool: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = (pool[0, i], pool[1, i]) if pool is not None else (torch.empty(0),) * 2

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
        plan = self.plan
        return {"memory_in_use_bytes": now, "serving_peak_bytes": peak,
                "warmup_peak_bytes": plan.warmup_peak_bytes if plan else 0,
                "activation_bytes": plan.activation_bytes if plan else 0,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size()}

    def _inputs(self, b: BatchDescription) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        tables_t = lens_t = None
        if b.decode_block_tables:
            width = max(len(t) for t in b.decode_block_tables)
            tables_t = torch.tensor([t + [0] * (width - len(t)) for t in b.decode_block_tables], dtype=torch.long,
                                    device=dev)
            lens_t = torch.tensor(b.decode_context_lens, dtype=torch.long, device=dev)
        prefills = [PrefillSpan(p.start, p.length, p.context_len, torch.tensor(p.block_table, dtype=torch.long,
                                                                                device=dev)) for p in b.prefills]
        meta = AttentionMetadata(torch.tensor(b.slots, dtype=torch.long, device=dev), b.num_decode, tables_t, lens_t,
                                 prefills)
        return (torch.tensor(b.input_ids, dtype=torch.long, device=dev),
                torch.tensor(b.positions, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def execute(self, batch: BatchDescription) -> WorkerOutput:
        for handle in batch.released:
            self.states.pop(handle, None)
        if batch.copies:
            self.copy_blocks(batch.copies)
        if not batch.input_ids:
            return WorkerOutput([], [], {})
        ids, positions, meta = self._inputs(batch)
        hidden = self.model(ids, positions, meta)
        tokens, lps = [], []
        if batch.sampling:
            logits = self.model.compute_logits(hidden[torch.tensor(batch.sample_rows, device=self.device)])
            states = [self._state(r.handle, r.seed) for r in batch.sampling]
            out = self.sampler(logits, batch.sampling, states)
            tokens, lps = out.token_ids, out.logprobs
        prompt_lps = {}
        for rows in batch.prompt_logprobs:
            logprobs = self.model.compute_logits(hidden[rows.start:rows.start + len(rows.targets)]).log_softmax(dim=-1)
            prompt_lps[rows.handle] = rank_logprobs(logprobs, rows.targets, rows.k)
        return WorkerOutput(tokens, lps, prompt_lps)

    def _state(self, handle: int, seed: int | None) -> RowState:
        state = self.states.get(handle)
        if state is None:
            state = self.states[handle] = RowState(seed)
        return state
