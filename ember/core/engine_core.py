"""The engine core: requests in, one step at a time, outputs out. It owns the scheduler, the block manager and the
after-step work, and drives its workers through an executor (one rank in process, or a model split over many)
with ``SchedulerOutput`` messages (new sequences once, then diffs); what it knows of the model and the KV pool
came back from the workers as data (``WorkerInfo``, ``PoolPlan``). It runs on one thread (``EngineLoop``) and
knows nothing of tokenizers, text or output streams.
"""

from __future__ import annotations

import time
from typing import Any

from ember.config import EngineConfig, ResolvedConfig, SchedulerConfig, SpeculativeConfig
from ember.core.batching import StepWriter
from ember.core.block_manager import BlockManager
from ember.core.decoding import Decoding
from ember.core.encoder_cache import EncoderCache
from ember.core.guided import GrammarSource, Guides
from ember.core.lora_slots import LoRASlots
from ember.core.request import CoreRequest
from ember.core.scheduler import Scheduler
from ember.core.speculator import Speculator
from ember.errors import ConfigError, EngineDeadError
from ember.executor import Executor, make_executor
from ember.lora.request import LoRARequest
from ember.model_loader import check_parallel, is_encoder, read_shape
from ember.protocol import (
    AbortRequest,
    AddRequests,
    EngineCommand,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    KVWindow,
    ModelInfo,
    PoolPlan,
    SchedulerOutput,
    SchedulerStats,
    StopSample,
    UtilityCall,
    UtilityResult,
    WorkerInfo,
)


def check_encoder_budget(sched: SchedulerConfig, what: str) -> None:
    """An encoder runs each prompt in one step: the step's budget must hold the longest."""
    if sched.max_num_batched_tokens < sched.max_model_len:
        raise ConfigError(f"max_num_batched_tokens={sched.max_num_batched_tokens} is out of range for {what}: a "
                          f"prompt runs in one step, so it must be >= max_model_len ({sched.max_model_len})")


class EngineCore:
    # what a client may call by name between steps (``EngineLoop.utility``), with plain arguments
    UTILITIES = frozenset({"add_lora", "remove_lora", "rank_reports", "stats"})

    @classmethod
    def check_utility(cls, method: str) -> str:
        """method, if it is one of ``UTILITIES``; else a ValueError naming what is allowed (raised in the caller)."""
        if method not in cls.UTILITIES:
            raise ValueError(f"{method!r} is not an engine utility; allowed: {sorted(cls.UTILITIES)}")
        return method

    @classmethod
    def start(cls, config: EngineConfig, resolved: ResolvedConfig,
              grammars: GrammarSource | None = None) -> "EngineCore":
        """Settle the limits and check the split from the checkpoint's config (a bad max_model_len or split fails
        before any weight loads or process starts), then start the executor's ranks and the core over them."""
        sched = config.scheduler(read_shape(resolved.model.path).max_position)
        if is_encoder(resolved.model.path):
            check_encoder_budget(sched, "an encoder")
        par = resolved.parallel
        check_parallel(resolved.model, par.tensor_parallel_size, par.pipeline_parallel_size, par.ranks_here)
        executor = make_executor(resolved)
        try:
            return cls(executor, sched, resolved, grammars)
        except BaseException:
            executor.shutdown()
            raise

    def __init__(self, executor: Executor, sched: SchedulerConfig, resolved: ResolvedConfig,
                 grammars: GrammarSource | None = None) -> None:
        """Over a started executor (any that speaks ``Executor``: tests give a scripted one): size the KV pool on
        every rank, then build the block manager and scheduler from the plan and model facts they return."""
        self.sched_config = sched
        self.executor = executor
        plan: PoolPlan = executor.collective_rpc("init_cache", (sched,))[0]
        info: WorkerInfo = executor.collective_rpc("info")[0]
        par = resolved.parallel
        cache = resolved.cache
        window = KVWindow(cache.attention_window, cache.sink_tokens) if cache.attention_window else None
        # an encoder attends over its whole prompt at once and keeps no KV: no chunks, nothing to cache; its blocks
        # only count what a step may admit
        encoder = info.encoder_only
        if encoder:
            check_encoder_budget(sched, info.architecture)
        self.block_manager = BlockManager(plan.num_blocks, cache.block_size,
                                          cache.enable_prefix_caching and not encoder, plan.num_host_blocks,
                                          cache.prefix_cache_ttl, window)
        lora = resolved.model.lora
        self.loras = LoRASlots(lora.max_loras) if lora is not None else None
        # a vision-language model: a step encodes at most a step's worth of image tokens; the workers keep the
        # encodings of twice that for repeated images
        self.encoder_cache = EncoderCache(sched.max_num_batched_tokens, 2 * sched.max_num_batched_tokens) \
            if info.image_token_id is not None else None
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.enable_chunked_prefill and not encoder, sched.policy,
                                   sched.max_num_prefill_seqs, self.loras, self.encoder_cache)
        # speculative decoding: from the sequences' own tokens when configured; predictions draft either way (not
        # under a StreamingLLM window: a rejected draft's KV would overwrite slots the window still reads)
        spec = resolved.speculative
        self.speculator = None if window is not None else Speculator(
            spec or SpeculativeConfig(), lookup=spec is not None, draft_cost=info.draft_cost,
            verify_costs=info.verify_costs, catch_up=info.draft_catch_up)
        self.decoding = Decoding(self.scheduler, self.block_manager, sched.max_model_len, self.speculator)
        self.guides = Guides(grammars)
        self.writer = StepWriter()
        self.requests: dict[str, CoreRequest] = {}
        self.model_info = ModelInfo(
            model=resolved.model.path, architecture=info.architecture, dtype=info.dtype,
            device=info.device, vocab_size=info.vocab_size, max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            block_size=cache.block_size, num_kv_blocks=plan.num_blocks, scheduling_policy=sched.policy,
            kv_cache_dtype=cache.kv_cache_dtype, quantization=info.quantization,
            tensor_parallel_size=par.tensor_parallel_size, pipeline_parallel_size=par.pipeline_parallel_size,
            executor=par.backend, attention_window=cache.attention_window, sink_tokens=cache.sink_tokens,
            max_loras=lora.max_loras if lora else 0, max_lora_rank=lora.max_rank if lora else 0,
            kv_block_bytes=info.kv_bytes_per_block, hidden_size=info.hidden_size, encoder_only=encoder,
            image_token_id=info.image_token_id, image_tokens=info.image_tokens, image_pixels=info.image_pixels,
            image_grid=info.image_grid)

    def handle(self, command: EngineCommand) -> EngineOutput | UtilityResult | None:
        """Run one command record (``Shutdown`` is the transport's to act on); what goes back to the client: an
        abort's output, a utility call's result or the exception it raised, else None."""
        if isinstance(command, AddRequests):
            for record in command.requests:
                self.add(record)
        elif isinstance(command, AbortRequest):
            return self.abort(command.request_id)
        elif isinstance(command, StopSample):
            self.stop_sample(command.request_id, command.index)
        elif isinstance(command, UtilityCall):
            try:
                return UtilityResult(command.call_id, getattr(self, command.method)(*command.args))
            except Exception as e:
                return UtilityResult(command.call_id, error=e)
        return None

    def add(self, record: EngineRequest) -> None:
        """Queue one request: one sample, or one beam search. A sample of an n > 1 request (``prefix_group``) caches
        its prompt's full blocks even when prefix caching is off (then under a key only its group shares), so the
        samples queued behind the first take its blocks, in the step that computes them or later."""
        p = record.params
        if p.n != 1 and not p.use_beam_search:
            raise ValueError(f"n={p.n}: a core request is one sample; fan n > 1 out in the front end "
                             "(ember.frontend.parallel_sampling.fan_out)")
        req = CoreRequest(record)
        bm = self.block_manager
        if record.prefix_group is not None and bm.window is None:  # a window's ring overwrites its blocks
            seq = req.seqs[0]
            seq.caches_prefix = True
            if not bm.enable_prefix_caching:
                seq.cache_salt = (record.cache_salt, "group", record.prefix_group)
        self.requests[record.request_id] = req
        self.scheduler.add(req.seqs[0])

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter now, rather than at its first request, when a slot is free or idle."""
        in_use = {s.request.lora_id for s in self.scheduler.running}
        if self.loras.can_take(lora.lora_int_id, in_use):
            self.loras.take(lora, in_use)
            result = self.executor.execute_model(SchedulerOutput(lora_loads=self.loras.take_loads()))
            if result is not None and result.lora_failures:
                self.loras.forget(lora.lora_int_id)
                raise ConfigError(next(iter(result.lora_failures.values())))

    def remove_lora(self, lora_id: int) -> None:
        """Free an adapter's slot, unless running requests use it (they finish with it, and the slot is reused
        once it is idle, as any other)."""
        if lora_id not in {s.request.lora_id for s in self.scheduler.running}:
            self.loras.forget(lora_id)

    def abort(self, request_id: str) -> EngineOutput | None:
        req = self.requests.pop(request_id, None)
        return self.decoding.abort(req) if req is not None else None

    def stop_sample(self, request_id: str, index: int) -> None:
        """The front end found a stop string in this sample's text: finish it now, before the next step."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if seq.index == index and not seq.is_finished:
                self.decoding.finish(seq, FinishReason.STOP, None, None)
        self._forget_finished([req])

    def check_ranks(self) -> None:
        """Raise EngineDeadError when a rank of the executor ended on its own; the loops ask while idle, so that a
        rank killed between requests stops the engine at once (and a server restarts it), not at the next step."""
        check = getattr(self.executor, "dead_ranks", None)
        died = check() if check is not None else []
        if died:
            raise EngineDeadError(f"a worker rank of the split model failed while the engine was idle: "
                                  f"{'; '.join(died)}. The engine has stopped; create a new one")

    def has_work(self) -> bool:
        """Sequences to run, or finished samples whose sampling state the worker should drop."""
        return self.scheduler.has_work() or bool(self.decoding.released)

    def step(self) -> list[EngineOutput]:
        self.block_manager.expire(time.monotonic())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.guides)
        batch = self.scheduler.schedule()
        catch_up = self.speculator.catch_up_orders(batch.seqs, batch.preempted) if self.speculator is not None else {}
        outputs: dict[str, EngineOutput] = {}
        for seq in batch.interrupted:
            self.decoding.interrupted(seq, outputs)
        released = self.decoding.take_released()
        self.guides.release(released)
        if self.speculator is not None:
            self.speculator.forget(released)
        if not batch.seqs:
            if batch.copies or released or batch.preempted:
                self.executor.execute_model(self.writer.write(batch, released, self.loras)[0])
        else:
            now = time.time()
            for seq in batch.seqs:
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = now
            message, sampled = self.writer.write(batch, released, self.loras)
            message.draft_catch_up = catch_up  # handles are sequence ids
            message.token_masks = self.guides.masks(sampled)  # computed while the model runs
            result = self.executor.execute_model(message)
            self.guides.advance(sampled, result.token_ids, message.token_masks)
            self.decoding.after_step(batch, sampled, result, outputs)
            if result.lora_failures:
                self._fail_loras(result.lora_failures, outputs)
        self._forget_finished(self.requests[rid] for rid in outputs if rid in self.requests)
        return list(outputs.values())

    def _fail_loras(self, failures: dict[int, str], outputs: dict[str, EngineOutput]) -> None:
        """Adapters the workers could not read this step: end every request that needs one (with the reason, in
        place of this step's output, whose tokens came from an empty slot) and free its slot; the next request
        naming it reads its files again. The blocks those requests hold leave the prefix cache first: the ones
        this step computed hold the base model's KV under the adapter's key (only its requests share them)."""
        for slot, why in failures.items():
            lora_id = self.loras.resident[slot]
            self.loras.forget(lora_id)
            for req in [r for r in self.requests.values() if r.lora_id == lora_id]:
                for seq in req.seqs:
                    self.block_manager.uncache(seq)
                outputs[req.request_id] = self.decoding.fail(req, why, outputs.get(req.request_id))

    def _forget_finished(self, reqs: Any) -> None:
        for req in list(reqs):
            if req.all_finished():
                self.requests.pop(req.request_id, None)

    def shutdown(self) -> None:
        """Stop the executor's ranks (a split model's processes); the core is unusable after."""
        self.guides.shutdown()
        self.executor.shutdown()

    def rank_reports(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every rank's place, weight and KV bytes and time in collectives, rank 0 first; reset: zero the times."""
        return self.executor.collective_rpc("report", (reset,))

    def stats(self) -> EngineStats:
        """The scheduler's counters and rank 0's memory figures."""
        bm, sched, guides = self.block_manager, self.scheduler, self.guides
        host = bm.host
        on_cpu = self.model_info.device == "cpu"
        return EngineStats(SchedulerStats(
            scheduling_policy=sched.policy, kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free,
            kv_cache_usage=bm.num_used / bm.num_blocks, running=len(sched.running), waiting=len(sched.waiting),
            preempted_waiting=sched.num_preempted_waiting, preemptions=sched.num_preemptions,
            interrupted=sched.num_interrupted, prefix_cache_hit_rate=bm.hit_rate,
            prefix_cache_hit_tokens=bm.hit_tokens, prefix_cache_host_hit_tokens=bm.host_hit_tokens,
            prefix_cache_ttl=bm.prefix_cache_ttl, prefix_cache_expired_blocks=bm.expired_blocks,
            host_tier=("off (CPU engine: the KV cache is in host memory)" if on_cpu and host is None
                       else "off" if host is None else f"{host.num_blocks} blocks"),
            host_blocks_cached=len(host.cached) if host is not None else 0,
            swapped_out_blocks=bm.swapped_out, swapped_in_blocks=bm.swapped_in,
            guided_steps=guides.steps, guided_rows=guides.masked_rows, guided_mask_seconds=guides.mask_seconds,
            guided_mask_wait_seconds=guides.wait_seconds,
            lora_slots=tuple(self.loras.resident) if self.loras else None,
            lora_swaps=self.loras.swaps if self.loras else None,
            images_encoded=self.encoder_cache.encoded if self.encoder_cache else None,
            **self._spec_stats()), self.executor.collective_rpc("stats")[0])

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None or (not self.speculator.lookup and not self.speculator.counts.drafts):
            return {}  # off, and no prediction drafted yet
        c = self.speculator.counts
        return dict(spec_decode_num_drafts=c.drafts, spec_decode_num_draft_tokens=c.drafted_tokens,
                    spec_decode_num_accepted_tokens=c.accepted_tokens,
                    spec_decode_accepted_per_position=tuple(c.accepted_per_position))
