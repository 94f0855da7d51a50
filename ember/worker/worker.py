"""A worker: owns the model, the KV pool and the samples' sampling state, and runs one ``BatchDescription`` per
call into sampled tokens and logprobs. It sees no tokenizer, no request object and no callback: everything it
gets is plain and picklable, which is what lets a worker run in another process or on another rank.

Split over ranks, every rank gets the same description. A rank runs its stage's layers on its heads; with several
pipeline stages the batch goes through in micro-batches (``micro_batches``), so stage s works on micro-batch m + 1
while stage s + 1 works on m. Only the sampling rank (TP rank 0 of the last stage) gathers the logits and samples,
and only it keeps the samples' sampling state.
"""

from __future__ import annotations

import logging
import time

import torch

from ember.config import CacheConfig, ModelConfig, SchedulerConfig
from ember.distributed import ParallelContext, comm
from ember.dtypes import name_of
from ember.kernels import kernels_for
from ember.layers.attention import AttentionMetadata, PrefillSpan, bind_attention_backend
from ember.layers.embedding import VocabEmbedding
from ember.layers.linear import Linear
from ember.layers.logits_processors import RowState
from ember.layers.lora import LoRABatch
from ember.layers.sampler import Sampler, rank_logprobs
from ember.lora.adapter import module_name, read_adapter
from ember.model_loader import load_model
from ember.protocol import (
    BatchDescription,
    BlockCopy,
    CopyKind,
    LoRALoad,
    PoolPlan,
    WorkerInfo,
    WorkerOutput,
    WorkerStats,
)
from ember.worker import startup
from ember.worker.cuda_graph import DecodeGraphs
from ember.worker.memory import memory_now

logger = logging.getLogger("ember")


def micro_batches(num_tokens: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` row ranges of the flat batch, as equal as rows allow. A range may end inside a prefill chunk: the
    chunk's second part runs after its first on every stage, so it finds the first part's K/V in the cache, as
    chunked prefill does."""
    cuts = [num_tokens * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class Worker:
    # what an executor may run on every rank by name (``Executor.collective_rpc``); steps go through execute_model
    RPC = frozenset({"init_cache", "info", "stats", "report"})

    @classmethod
    def check_rpc(cls, method: str) -> str:
        """method, if it is one of ``RPC``; else a ValueError naming what is allowed."""
        if method not in cls.RPC:
            raise ValueError(f"collective_rpc: {method!r} is not a worker method one may call; allowed: "
                             f"{sorted(cls.RPC)}")
        return method

    def __init__(self, model_config: ModelConfig, cache: CacheConfig,
                 parallel: ParallelContext = ParallelContext()) -> None:
        if model_config.num_threads is not None:
            torch.set_num_threads(model_config.num_threads)
        torch.manual_seed(model_config.seed)
        self.cache_config = cache
        self.parallel = parallel
        self.loaded = load_model(model_config, parallel)
        self.model = self.loaded.model
        self.device = torch.device(model_config.device)
        self.block_size = cache.block_size
        self.sampler = Sampler(self.loaded.shape.vocab_size, seed=model_config.seed)
        self.states: dict[int, RowState] = {}  # sample handle -> its sampling state, until released
        self.layers = self.model.attention_layers()
        self.kv_format = fmt = startup.kv_format(self.loaded, cache.kv_cache_dtype)
        for layer in self.layers:
            layer.kv_format = fmt
        first = self.layers[0]
        self._kv_shape = (len(self.layers), cache.block_size, first.num_kv_heads, fmt.entry)
        kernels_for(self.device)  # compile (first run on this machine) or load the CPU kernels now, not mid-step
        self.lora = model_config.lora
        self.enforce_eager = model_config.enforce_eager
        self.graphs: DecodeGraphs | None = None  # CUDA: captured by ``capture_graphs`` at start-up
        if self.lora is not None:
            self.model.enable_lora(self.lora.max_loras, self.lora.max_rank, self.device)
        self.attention_backend = bind_attention_backend(self.layers, self.device, fmt, cache.block_size,
                                                        batch_invariant=model_config.batch_invariant)
        self.kv_cache = torch.empty(0)
        self.host_cache: torch.Tensor | None = None
        self.plan: PoolPlan | None = None

    def info(self) -> WorkerInfo:
        """The loaded model's facts, as data for the engine core."""
        loaded = self.loaded
        return WorkerInfo(architecture=loaded.architecture, dtype=name_of(loaded.dtype), device=str(self.device),
                          vocab_size=loaded.shape.vocab_size,
                          quantization=loaded.quant.describe() if loaded.quant else None,
                          kv_bytes_per_block=startup.kv_bytes_per_block(loaded, self.block_size,
                                                                        self.cache_config.kv_cache_dtype))

    def init_cache(self, sched: SchedulerConfig) -> PoolPlan:
        """Measure, size and allocate the KV pool (and host tier), then warm up; see ``startup``."""
        self.plan, self.kv_cache, self.host_cache = startup.start(self, self.cache_config, sched)
        return self.plan

    def capture_graphs(self, max_num_seqs: int, max_len: int) -> None:
        """CUDA graphs of the decode step (``cuda_graph``), where they apply: one CUDA rank, no LoRA, the
        ``triton`` attention backend, enforce_eager off. A capture that fails leaves decode eager, with a warning."""
        if (self.device.type != "cuda" or self.enforce_eager or self.parallel.world_size > 1 or self.lora is not None
                or self.attention_backend.name != "triton"):
            return
        graphs = DecodeGraphs(max_num_seqs, -(-max_len // self.block_size), self.device)
        start = time.perf_counter()
        try:
            graphs.capture(lambda ids, positions, meta: self.model(ids, positions, meta))
        except Exception as e:  # noqa: BLE001 -- a kernel or op that cannot be captured: serve eagerly, say so
            logger.warning("CUDA graphs not captured, decode runs eagerly: %s: %s", type(e).__name__,
                           (str(e).splitlines() or [""])[0])
            return
        self.graphs = graphs
        logger.info("CUDA graphs: decode batches of %s captured in %.1f s", graphs.sizes,
                    time.perf_counter() - start)

    def new_pool(self, num_blocks: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
        # zeros, not empty: padded decode batches read unused slots, and NaN garbage there would survive the mask
        return torch.zeros(2, self._kv_shape[0], num_blocks, *self._kv_shape[1:], dtype=self.kv_format.pool_dtype,
                           device=device or self.device, pin_memory=pin)

    def bind(self, pool: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = (pool[0, i], pool[1, i]) if pool is not None else (torch.empty(0),) * 2

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the block copies queued by the block manager (host tier, copy-on-write), in order (runs of one kind
        together)."""
        i = 0
        while i < len(copies):
            j = i
            while j < len(copies) and copies[j].kind is copies[i].kind:
                j += 1
            src = torch.tensor([c.src for c in copies[i:j]], dtype=torch.long)
            dst = torch.tensor([c.dst for c in copies[i:j]], dtype=torch.long)
            if copies[i].kind is CopyKind.COPY:  # within the pool: every layer's K and V of the block
                self.kv_cache.index_copy_(2, dst.to(self.device), self.kv_cache.index_select(2, src.to(self.device)))
            elif copies[i].kind is CopyKind.SWAP_OUT:
                blocks = self.kv_cache.index_select(2, src.to(self.device)).to("cpu")
                self.host_cache.index_copy_(2, dst, blocks)
            else:
                blocks = self.host_cache.index_select(2, src).to(self.device, non_blocking=True)
                self.kv_cache.index_copy_(2, dst.to(self.device), blocks)
            i = j

    def stats(self) -> WorkerStats:
        """Memory now and the peak since warm-up, next to the warm-up's peak (CUDA: allocator; CPU: RSS)."""
        now, peak = memory_now(self.device)
        plan = self.plan
        return WorkerStats(kv_budget_source=plan.budget_source if plan else "",
                           attention_backend=self.attention_backend.name, memory_in_use_bytes=now,
                           serving_peak_bytes=peak, warmup_peak_bytes=plan.warmup_peak_bytes if plan else 0,
                           activation_bytes=plan.activation_bytes if plan else 0,
                           kv_cache_bytes=self.kv_cache.numel() * self.kv_cache.element_size())

    def agree_min(self, value: int) -> int:
        """The smallest value over every rank (the KV pool size all ranks can hold)."""
        if self.parallel.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.parallel.control_group)
        return int(t.item())

    def load_lora(self, load: LoRALoad) -> None:
        """Read an adapter into a slot: this rank's slice of each of its modules (a column-parallel projection's
        B rows, a row-parallel one's A columns, as ``weight_slice`` cuts the base weight), zeros elsewhere."""
        # read in float32: the scaling is folded into B before the one rounding to the model's dtype
        adapter = read_adapter(load.path, load.path, self.loaded.shape, self.lora.max_rank)
        for stack in self.model.lora_stacks():
            stack.clear(load.slot)
        for (layer, proj), w in adapter.weights.items():
            target = self.model.lora_target(layer, proj)
            if target is None:
                continue
            cut = self.model.weight_slice(module_name(layer, proj) + ".weight")
            a = cut.apply(w.a) if cut.dim == 1 else w.a
            b = cut.apply(w.b) if cut.dim == 0 else w.b
            target[0].set(load.slot, target[1], a.to(self.device), b.to(self.device), w.scaling)

    def _lora_batch(self, b: BatchDescription, r0: int, r1: int) -> LoRABatch | None:
        if b.lora_slots is None or self.lora is None:
            return None
        return LoRABatch.of(b.lora_slots[r0:r1], self.lora.max_loras, self.lora.max_rank, self.loaded.dtype,
                            self.device)

    def _inputs(self, b: BatchDescription, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Tensors of rows [r0, r1) of the batch (all of it, or one micro-batch)."""
        dev = self.device
        tables_t = lens_t = None
        d0, d1 = min(r0, b.num_decode), min(r1, b.num_decode)
        if d1 > d0:
            tables = b.decode_block_tables[d0:d1]
            width = max(len(t) for t in tables)
            tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
            lens_t = torch.tensor(b.decode_context_lens[d0:d1], dtype=torch.long, device=dev)
        prefills = []
        for p in b.prefills:
            start, stop = max(p.start, r0), min(p.start + p.length, r1)
            if stop > start:  # the part of this chunk in range; its context ends where the part ends
                prefills.append(PrefillSpan(start - r0, stop - start, p.context_len - (p.start + p.length - stop),
                                            torch.tensor(p.block_table, dtype=torch.long, device=dev)))
        ids, positions, slots = b.input_ids, b.positions, b.slots
        if (r0, r1) != (0, b.num_tokens):  # one micro-batch (a single stage copies nothing)
            ids, positions, slots = ids[r0:r1], positions[r0:r1], slots[r0:r1]
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), d1 - d0, tables_t, lens_t,
                                 prefills)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    def forward_stage(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                      ) -> torch.Tensor | None:
        """This rank's layers alone, without stage-to-stage traffic (warm-up): a later stage starts from zeros.
        The last stage's hidden states; None on other stages."""
        p = self.parallel
        intermediate = None
        if not p.is_first_stage:
            zeros = torch.zeros(len(ids), self.loaded.shape.hidden_size, dtype=self.loaded.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        out = self.model(ids, positions, meta, intermediate)
        return out if p.is_last_stage else None

    def _forward(self, b: BatchDescription) -> torch.Tensor | None:
        """The whole batch through this rank's stage; the last stage's hidden states, None on other stages."""
        p = self.parallel
        graphs = self.graphs
        if (graphs is not None and b.num_decode == b.num_tokens
                and graphs.fits(b.num_decode, max(len(t) for t in b.decode_block_tables))):
            return graphs.run(b.input_ids, b.positions, b.slots, b.decode_block_tables, b.decode_context_lens)
        if p.pp_size == 1:
            return self.model(*self._inputs(b, 0, b.num_tokens), None, self._lora_batch(b, 0, b.num_tokens))
        outs, sends = [], []
        hidden = self.loaded.shape.hidden_size
        for r0, r1 in micro_batches(b.num_tokens, p.pp_size):
            ids, positions, meta = self._inputs(b, r0, r1)
            intermediate = None
            if not p.is_first_stage:
                buf = comm.recv((2, r1 - r0, hidden), self.loaded.dtype, self.device, p.stage_peer(-1))
                intermediate = (buf[0], buf[1])
            out = self.model(ids, positions, meta, intermediate, self._lora_batch(b, r0, r1))
            if p.is_last_stage:
                outs.append(out)
            else:  # (x, residual) to the same TP rank of the next stage; on to the next micro-batch meanwhile
                x = torch.stack(out)
                sends.append((comm.send(x, p.stage_peer(1)), x))
        for work, _ in sends:
            work.wait()
        return torch.cat(outs) if outs else None

    @torch.inference_mode()
    def execute_model(self, batch: BatchDescription) -> WorkerOutput | None:
        """The sampled tokens on the sampling rank; None on every other rank."""
        for handle in batch.released:
            self.states.pop(handle, None)
        if batch.copies:
            self.copy_blocks(batch.copies)
        for load in batch.lora_loads:
            self.load_lora(load)
        if not batch.input_ids:
            return WorkerOutput([], [], {}) if self.parallel.is_sampler else None
        hidden = self._forward(batch)
        if hidden is None:
            return None
        tokens, lps, beams = [], [], {}
        if batch.sampling:  # every TP rank lends its vocabulary slice; TP rank 0 samples
            logits = self.model.compute_logits(hidden[torch.tensor(batch.sample_rows, device=self.device)])
            if logits is not None:
                states = [self._state(r.handle, r.seed) for r in batch.sampling]
                out = self.sampler(logits, batch.sampling, states, batch.token_masks)
                tokens, lps, beams = out.token_ids, out.logprobs, out.beams
        prompt_lps = {}
        for rows in batch.prompt_logprobs:
            logits = self.model.compute_logits(hidden[rows.start:rows.start + len(rows.targets)])
            if logits is not None:
                prompt_lps[rows.handle] = rank_logprobs(logits.log_softmax(dim=-1), rows.targets, rows.k)
        return WorkerOutput(tokens, lps, prompt_lps, beams) if self.parallel.is_sampler else None

    def report(self, reset: bool = False) -> dict[str, object]:
        """This rank's place, its bytes of weights and KV, and its time in collectives since the last reset (for
        docs/parallel.md)."""
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        for m in self.model.modules():
            if isinstance(m, Linear) and m.qmm is not None:
                weights += sum(t.numel() * t.element_size() for t in m.qmm.impl.tensors())
            elif isinstance(m, VocabEmbedding) and m.qt is not None:
                weights += m.qt.nbytes()
        p = self.parallel
        return {"rank": p.world_rank, "tp_rank": p.tp_rank, "pp_rank": p.pp_rank, "layers": self.loaded.local_layers,
                "kv_heads": self.loaded.local_kv_heads, "weight_bytes": weights,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size(), **comm.COMM.snapshot(reset)}

    def _state(self, handle: int, seed: int | None) -> RowState:
        state = self.states.get(handle)
        if state is None:
            state = self.states[handle] = RowState(seed)
        return state
