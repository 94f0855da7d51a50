"""A worker: one rank's device, its share of the model, its KV pool and the calls the executor may make on it
(``RPC``, and ``execute_model`` each step). The step itself is the model runner's (``model_runner.ModelRunner``):
it keeps the sequences between steps and turns each ``SchedulerOutput`` into a forward pass and sampled tokens.
Everything a worker gets is plain and picklable, which is what lets it run in another process or on another rank.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from ember.config import CacheConfig, ModelConfig, SchedulerConfig
from ember.distributed import ParallelContext, comm
from ember.dtypes import name_of
from ember.errors import ConfigError
from ember.kernels import kernels_for
from ember.layers.attention import AttentionMetadata, bind_attention_backend
from ember.layers.embedding import VocabEmbedding
from ember.layers.linear import Linear
from ember.model_loader import LoadedModel, load_model, shared_vocabulary
from ember.protocol import (
    BlockCopy,
    CopyKind,
    KVWindow,
    PoolPlan,
    SchedulerOutput,
    WorkerInfo,
    WorkerOutput,
    WorkerStats,
)
from ember.quantization.held import HELD_KINDS, describe_held, held_kinds, takes_int8_activations
from ember.worker import startup
from ember.worker.cuda_graph import DecodeGraphs
from ember.worker.drafter import Drafter, measure_draft_costs
from ember.worker.model_runner import ModelRunner
from ember.worker.memory import memory_now
from ember.worker.verify_cost import MAX_TIMED_DRAFT, measure_verify_costs

logger = logging.getLogger("ember")


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
        self.layers = self.model.attention_layers()
        # an encoder (BERT) attends over each prompt on its own and keeps no KV: no paged layers, no pool
        self.encoder_only = bool(getattr(self.model, "encoder_only", False))
        self.kv_format = fmt = startup.kv_format(self.loaded, cache.kv_cache_dtype)
        for layer in self.layers:
            layer.kv_format = fmt
        self._kv_shape = (len(self.layers), cache.block_size, self.layers[0].num_kv_heads if self.layers else 0,
                          fmt.entry)
        kernels_for(self.device)  # compile (first run on this machine) or load the CPU kernels now, not mid-step
        self.lora = model_config.lora
        self.enforce_eager = model_config.enforce_eager
        self.int8_activations = model_config.int8_activations
        if self.lora is not None:
            self.model.enable_lora(self.lora.max_loras, self.lora.max_rank, self.device)
        self.attention_backend = None if self.encoder_only else bind_attention_backend(
            self.layers, self.device, fmt, cache.block_size, batch_invariant=model_config.batch_invariant)
        self.kv_cache = torch.empty(0)
        self.host_cache: torch.Tensor | None = None
        self.plan: PoolPlan | None = None
        self.draft_cost: float | None = None  # a draft model's decode step against this model's (init_cache)
        self.draft_catch_up: int | None = None  # the prompt tokens a step may feed its KV (init_cache)
        self.verify_costs: tuple[float, ...] | None = None  # a step verifying k drafted tokens (init_cache)
        self.verify_tokens = model_config.verify_tokens
        window = KVWindow(cache.attention_window, cache.sink_tokens) if cache.attention_window else None
        self.runner = ModelRunner(self.loaded, self.device, cache.block_size, parallel, model_config.seed, self.lora,
                                  window)
        draft = model_config.draft
        if draft is not None:  # speculative decoding's draft model: its own weights and KV pool, the target's blocks
            drafting = load_draft(draft)
            rows = drafting.shape.vocab_size, self.loaded.shape.vocab_size
            # TP rank 0 checks the tokenizers (its drafts are every rank's: broadcast), the others take the rows
            limit = shared_vocabulary(draft, model_config, *rows) if parallel.tp_rank == 0 else min(rows)
            self.runner.drafter = Drafter(drafting, self.device, cache.block_size, cache.kv_cache_dtype,
                                          model_config.batch_invariant, limit)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """CUDA: the decode step's graphs, captured by ``capture_graphs`` at start-up."""
        return self.runner.graphs

    def info(self) -> WorkerInfo:
        """The loaded model's facts, as data for the engine core."""
        loaded = self.loaded
        return WorkerInfo(architecture=loaded.architecture, dtype=name_of(loaded.dtype), device=str(self.device),
                          vocab_size=loaded.shape.vocab_size, quantization=self._quantization(),
                          kv_bytes_per_block=startup.kv_bytes_per_block(loaded, self.block_size,
                                                                        self.cache_config.kv_cache_dtype),
                          draft_cost=self.draft_cost, verify_costs=self.verify_costs,
                          draft_catch_up=self.draft_catch_up,
                          hidden_size=loaded.shape.hidden_size, encoder_only=self.encoder_only,
                          image_token_id=getattr(self.model, "image_token_id", None),
                          image_tokens=getattr(self.model, "image_tokens", None),
                          image_pixels=getattr(self.model, "image_pixels", None),
                          image_grid=bool(getattr(self.model, "mrope", False)))

    def init_cache(self, sched: SchedulerConfig) -> PoolPlan:
        """Measure, size and allocate the KV pool (and host tier), then warm up; see ``startup``."""
        drafter = self.runner.drafter
        if drafter is not None and drafter.loaded.shape.max_position < sched.max_model_len:
            raise ConfigError(f"speculative_config.model supports {drafter.loaded.shape.max_position} positions, "
                              f"fewer than max_model_len={sched.max_model_len}: lower max_model_len or draft with a "
                              "model as long as the target")
        if self.encoder_only:
            self.plan = startup.encoder_plan(self.cache_config, sched)
            return self.plan
        self.plan, self.kv_cache, self.host_cache = startup.start(self, self.cache_config, sched)
        if drafter is not None:  # a draft token's cost against a target step, measured here and now
            drafter.max_tokens = sched.max_num_batched_tokens  # its passes: a step's budget at most
            context = min(64, self.plan.num_blocks * self.block_size)
            costs = measure_draft_costs(self.model, drafter.model, self.device, self.block_size, context,
                                        sched.max_num_batched_tokens)
            self.draft_cost, self.draft_catch_up = costs.token, costs.catch_up_tokens
            width = -(-context // self.block_size)
            self.kv_cache[:, :, :width].zero_()
            drafter.pool[:, :, :width].zero_()
            logger.info("draft model: a draft token costs %.2f of a decode step; a catch-up feeds %d prompt tokens "
                        "a step", self.draft_cost, self.draft_catch_up)
        context = min(128, self.plan.num_blocks * self.block_size, sched.max_model_len)
        most = min(self.verify_tokens, MAX_TIMED_DRAFT)  # longer drafts: extrapolated by the speculator
        if most and self.parallel.world_size == 1 and self.device.type == "cpu" and context > most:
            # what verifying k drafted tokens costs here (every rank would have to run it together: one rank only;
            # CUDA decodes through graphs, which an eager timing would not see: the constants there)
            self.verify_costs = measure_verify_costs(self.model, self.device, self.block_size, context, most)
            self.kv_cache[:, :, :-(-context // self.block_size)].zero_()
            shown = [k for k in (1, 2, 4, 8, 16, 24) if k <= most]
            logger.info("speculative decoding: verifying %s drafted tokens costs %s decode steps",
                        " / ".join(map(str, shown)), " / ".join(f"{self.verify_costs[k]:.2f}" for k in shown))
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
        self.runner.graphs = graphs
        logger.info("CUDA graphs: decode batches of %s captured in %.1f s", graphs.sizes,
                    time.perf_counter() - start)

    def new_pool(self, num_blocks: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
        # zeros, not empty: padded decode batches read unused slots, and NaN garbage there would survive the mask
        return torch.zeros(2, self._kv_shape[0], num_blocks, *self._kv_shape[1:], dtype=self.kv_format.pool_dtype,
                           device=device or self.device, pin_memory=pin)

    def draft_bytes_per_block(self) -> int:
        """A block's bytes in the draft model's pool (0: no draft model): start-up sizes both pools together."""
        drafter = self.runner.drafter
        return drafter.bytes_per_block() if drafter is not None else 0

    def bind(self, pool: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = (pool[0, i], pool[1, i]) if pool is not None else (torch.empty(0),) * 2
        if self.runner.drafter is not None:  # the draft's pool: the same block numbers
            self.runner.drafter.bind(pool.shape[2] if pool is not None else None)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Run the block copies queued by the block manager (host tier, copy-on-write), in order (runs of one kind
        together, ``copy_runs``)."""
        for kind, sources, destinations in copy_runs(copies):
            src = torch.tensor(sources, dtype=torch.long)
            dst = torch.tensor(destinations, dtype=torch.long)
            if kind is CopyKind.COPY:  # within the pool: every layer's K and V of the block
                self.kv_cache.index_copy_(2, dst.to(self.device), self.kv_cache.index_select(2, src.to(self.device)))
                if self.runner.drafter is not None:
                    self.runner.drafter.copy_blocks(src, dst)
            elif kind is CopyKind.SWAP_OUT:
                blocks = self.kv_cache.index_select(2, src.to(self.device)).to("cpu")
                self.host_cache.index_copy_(2, dst, blocks)
            else:
                blocks = self.host_cache.index_select(2, src).to(self.device, non_blocking=True)
                self.kv_cache.index_copy_(2, dst.to(self.device), blocks)

    def stats(self) -> WorkerStats:
        """Memory now and the peak since warm-up, next to the warm-up's peak (CUDA: allocator; CPU: RSS)."""
        now, peak = memory_now(self.device)
        plan, drafter = self.plan, self.runner.drafter
        return WorkerStats(kv_budget_source=plan.budget_source if plan else "",
                           attention_backend=self.attention_backend.name if self.attention_backend else "sdpa",
                           memory_in_use_bytes=now,
                           serving_peak_bytes=peak, warmup_peak_bytes=plan.warmup_peak_bytes if plan else 0,
                           activation_bytes=plan.activation_bytes if plan else 0,
                           kv_cache_bytes=self.kv_cache.numel() * self.kv_cache.element_size()
                           + (drafter.pool.numel() * drafter.pool.element_size() if drafter is not None else 0))

    def _quantization(self) -> str | None:
        """The weight layout in words: the config's, or for the mixed layout (and with int8 activations, which only
        some weights may take) the kinds held and their shares, summed over every rank (each pipeline stage holds
        its own layers; every rank runs ``info``)."""
        quant = self.loaded.quant
        if quant is None or not (quant.mixed or self.int8_activations):
            return quant.describe() if quant else None
        counts = held_kinds(self.model)
        held = dict(zip(HELD_KINDS, self.agree_sum([counts.get(kind, 0) for kind in HELD_KINDS])))
        if not quant.mixed and not takes_int8_activations(held):
            return quant.describe()  # int8 activations asked for, taken by no weight: the config's words
        return describe_held(held, quant.describe())

    def _agree(self, values: list[int], op: str) -> list[int]:
        """Each value reduced over every rank with ``op`` ('SUM', 'MIN': a torch.distributed.ReduceOp)."""
        if self.parallel.world_size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.parallel.control_group)
        return [int(v) for v in t.tolist()]

    def agree_sum(self, values: list[int]) -> list[int]:
        """Each value summed over every rank."""
        return self._agree(values, "SUM")

    def agree_min(self, value: int) -> int:
        """The smallest value over every rank (the KV pool size all ranks can hold)."""
        return self._agree([value], "MIN")[0]

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

    def execute_model(self, batch: SchedulerOutput) -> WorkerOutput | None:
        """Run the step's block copies, then the step (``ModelRunner.execute``): the sampled tokens on the sampling
        rank, None on every other rank."""
        if batch.copies:
            with torch.inference_mode():
                self.copy_blocks(batch.copies)
        return self.runner.execute(batch)

    def report(self, reset: bool = False) -> dict[str, object]:
        """This rank's place, its bytes of weights and KV, and its time in collectives since the last reset (for
        docs/parallel.md)."""
        weights = weight_bytes(self.model)
        p, drafter = self.parallel, self.runner.drafter
        draft = {} if drafter is None else {  # each rank holds the whole draft model and its pool
            "draft_weight_bytes": weight_bytes(drafter.model),
            "draft_kv_cache_bytes": drafter.pool.numel() * drafter.pool.element_size()}
        return {"rank": p.world_rank, "tp_rank": p.tp_rank, "pp_rank": p.pp_rank, "layers": self.loaded.local_layers,
                "kv_heads": self.loaded.local_kv_heads, "weight_bytes": weights,
                "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size(), **draft,
                **comm.COMM.snapshot(reset)}


def copy_runs(copies: list[BlockCopy]) -> list[tuple[CopyKind, list[int], list[int]]]:
    """The copies as runs of one kind, in order, each run's sources and destinations, a destination written once:
    by the run's last copy to it (a step that evicts more blocks than the host tier holds stores two in one host
    block, the second replacing the first, and ``index_copy_`` leaves the order of a repeated index undefined: the
    tier could hold the first block's KV under the second's hash)."""
    runs = []
    for kind, run in itertools.groupby(copies, key=lambda c: c.kind):
        last = {c.dst: c.src for c in run}  # a later copy to a destination replaces an earlier one
        runs.append((kind, list(last.values()), list(last.keys())))
    return runs


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's weights as held (quantized layers' packed tensors included)."""
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    for m in model.modules():
        if isinstance(m, Linear) and m.qmm is not None:
            total += sum(t.numel() * t.element_size() for t in m.qmm.tensors())
        elif isinstance(m, VocabEmbedding) and m.qt is not None:
            total += m.qt.nbytes()
        elif isinstance(m, VocabEmbedding) and m.table6 is not None:
            total += sum(t.numel() * t.element_size() for t in m.table6.tensors())
    return total


def load_draft(config: ModelConfig) -> LoadedModel:
    """The draft model, whole on this rank."""
    try:
        return load_model(config, ParallelContext())
    except ValueError as e:  # the layout asked for does not fit the file: named as the user wrote it
        if str(e).startswith("quantization="):
            raise ConfigError(f"speculative_config.{e}") from None
        raise
