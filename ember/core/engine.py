"""The engine: one background thread runs the loop schedule -> run model -> sample -> emit outputs.

Callers on any thread submit requests and aborts through a thread-safe queue; each request's outputs go to its
own sink. Requests are tokenized and validated in the caller's thread, so a bad one is refused before it can
disturb the requests in flight.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from ember.config import EngineConfig
from ember.core.block_manager import BlockManager
from ember.core.model_runner import ModelRunner
from ember.core.output_processor import append_token, prompt_logprobs
from ember.core.request import OutputSink, Request
from ember.core.scheduler import Scheduler
from ember.model_loader import load_model
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")

PromptType = str | Seq[int]
_STOP = object()


class EngineDeadError(RuntimeError):
    pass


class Engine:
    """Loads the model and runs every tensor operation on its own thread.

    Keeping all torch work on one thread matters on CPU: OpenMP gives each thread that runs parallel ops its own
    team, and once the teams hold more threads than there are cores, libgomp stops spinning between ops and every
    small op pays a wake-up (measured: a tiny softmax 3 us -> 60 us). So the caller's thread does no torch work."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}
        self._live_ids: set[str] = set()
        self._ids_lock = threading.Lock()
        self._counter = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._dead: BaseException | None = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ember-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    def _init_state(self) -> None:
        config = self.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.loaded = load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.hf_config.vocab_size
        self.max_model_len = config.max_model_len or self.loaded.max_position
        default_budget = 2048 if config.enable_chunked_prefill else max(self.max_model_len, 2048)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is out of range: without chunked "
                             f"prefill it must be >= max_model_len ({self.max_model_len}) so any prompt fits a step")
        self.runner = ModelRunner(config, self.loaded, self.max_model_len, self.max_num_batched_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.runner.num_host_blocks, config.prefix_cache_ttl)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy)
        self.default_params = SamplingParams.from_generation_config(self.loaded.generation_config)

    def _main(self) -> None:
        try:
            self._init_state()
        except BaseException as e:
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    # ----- caller side (any thread) -----

    def make_request(self, prompt: PromptType, params: SamplingParams | None, sink: OutputSink,
                     request_id: str | None = None) -> Request:
        """Tokenize and validate; raises ValueError naming the bad field before anything is queued."""
        params = (params or self.default_params).clone()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt='' is empty: a prompt needs at least one character or token")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Seq) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt of type {type(prompt).__name__} is not supported: pass a string or a list of "
                             "token ids")
        if not ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range: token ids must be in [0, {self.vocab_size})")
        if len(ids) + max(1, params.min_tokens) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens: prompt length plus min_tokens (at least 1 new token) "
                             f"must be <= max_model_len ({self.max_model_len})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} is out of range: n must be <= max_num_seqs ({self.config.max_num_seqs})")
        max_num_tokens = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        self._check_fits(len(ids), params, max_num_tokens)
        if not params.eos_token_ids:
            params.eos_token_ids = self.loaded.eos_token_ids
        for name, given in (("stop_token_ids", params.stop_token_ids), ("eos_token_ids", params.eos_token_ids),
                            ("stop_token_sequences", [t for s in params.stop_token_sequences for t in s]),
                            ("bad_words_ids", [t for s in params.bad_words_ids for t in s])):
            bad = [t for t in given if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds {bad[0]}, out of range: token ids must be in [0, {self.vocab_size})")
        rid = str(next(self._counter)) if request_id is None else str(request_id)
        return Request(rid, text, ids, params, self.tokenizer, sink, max_num_tokens)

    def _check_fits(self, prompt_len: int, params: SamplingParams, max_num_tokens: int) -> None:
        """Refuse a request the KV pool can never hold (under guaranteed_no_evict: never reserve for)."""
        bm, bs = self.block_manager, self.config.block_size
        pool = bm.num_blocks * bs
        least = prompt_len + max(1, params.min_tokens)
        if bm.blocks_for(least) > bm.num_blocks:
            raise ValueError(f"prompt has {prompt_len} tokens: prompt plus min_tokens ({least} tokens) can never fit "
                             f"the KV pool of {pool} tokens; it must be <= {pool}")
        if self.config.scheduling_policy == "guaranteed_no_evict":
            need = bm.request_blocks(prompt_len, max_num_tokens, params.n)
            if need > bm.num_blocks:
                raise ValueError(f"max_tokens={params.max_tokens} with n={params.n} needs {need} KV blocks under "
                                 f"scheduling_policy='guaranteed_no_evict', more than the pool's {bm.num_blocks}: "
                                 "lower max_tokens or n, or use 'max_utilization'")

    def submit(self, requests: list[Request]) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}")
        with self._ids_lock:
            dup = [r.request_id for r in requests if r.request_id in self._live_ids]
            ids = [r.request_id for r in requests]
            if dup or len(set(ids)) != len(ids):
                raise ValueError(f"request_id={(dup or ids)[0]!r} is already in use: request ids must be unique")
            self._live_ids.update(ids)
        self._inbox.put(("add", requests))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", str(request_id)))

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()

    # ----- engine thread -----

    def _loop(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException as e:  # never leave a consumer waiting forever
            logger.exception("engine loop failed")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {e!r}"))

    def _run_once(self) -> bool:
        """Take every pending command (waiting for one when idle), then run one step. False: shut down."""
        try:
            item = self._inbox.get(block=not self.scheduler.has_work())
        except queue.Empty:
            item = None
        while item is not None:
            if item is _STOP:
                self._fail_all(EngineDeadError("the engine was shut down"))
                return False
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if self.scheduler.has_work():
            self.step()
        return True

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "add":
            for req in payload:
                self.requests[req.request_id] = req
                self.scheduler.add(req.seqs[0])
        elif kind == "abort":
            req = self.requests.get(payload)
            if req is not None:
                for seq in req.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq)
                req.finish_all("abort")
                self._emit(req)

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            req.sink(error)
        self.requests.clear()
        with self._ids_lock:
            self._live_ids.clear()

    def _emit(self, req: Request) -> None:
        delta = req.take_delta()
        if delta is not None:
            req.sink(delta)
        if req.finished:
            self.requests.pop(req.request_id, None)
            with self._ids_lock:
                self._live_ids.discard(req.request_id)

    def step(self) -> None:
        self.block_manager.expire(time.monotonic())
        batch = self.scheduler.schedule()
        for seq in batch.interrupted:
            self._interrupted(seq)
        if not batch.seqs:
            if batch.copies:
                self.runner.copy_blocks(batch.copies)
            return
        now = time.time()
        for seq in batch.seqs:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        out = self.runner.execute(batch)
        touched: dict[str, Request] = {}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            req = seq.request
            touched[req.request_id] = req
            if seq.seq_id in out.prompt_logprobs:
                lps, ids, first = out.prompt_logprobs[seq.seq_id]
                if first == 0:  # the prompt's first token has no logprob; a recompute starts over
                    req.pending_prompt_logprobs = [None]
                req.pending_prompt_logprobs.extend(prompt_logprobs(self.tokenizer, lps, ids,
                                                                   req.params.prompt_logprobs))
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    req.prompt_logprobs = req.pending_prompt_logprobs
            if seq.pending_fork and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)
        if out.sampler is not None:
            for seq, token, lp in zip(out.sampled, out.sampler.token_ids, out.sampler.logprobs):
                if append_token(seq, token, lp, self.tokenizer, self.max_model_len):
                    self.scheduler.finish(seq)
        for req in touched.values():
            self._emit(req)

    def _interrupted(self, seq: Any) -> None:
        """The policy gave seq up: it ends with finish_reason "interrupted" and keeps its tokens."""
        req = seq.request
        logger.warning("request %s: sample %d interrupted (it no longer fits the KV pool)", req.request_id, seq.index)
        if seq.pending_fork:  # its siblings never started: they end with it
            for child in req.fork(seq):
                child.status, child.finish_reason = seq.status, "interrupted"
        if seq.detokenizer is not None:
            seq.detokenizer.flush_incomplete()
        self._emit(req)

    def _fork(self, parent: Any) -> None:
        """The prompt is in the cache: start the other n - 1 samples on its full blocks."""
        bs = self.config.block_size
        shared = self.block_manager.shared_prompt_blocks(parent.num_prompt_tokens) * bs
        for child in parent.request.fork(parent):
            self.block_manager.share(parent, child, shared)
            child.num_computed_tokens = shared
            self.scheduler.add_running(child)

    def stats(self) -> dict[str, Any]:
        """Engine counters (thread-safe enough for monitoring: plain reads of ints and lists)."""
        bm, sched = self.block_manager, self.scheduler
        host = bm.host
        return {
            "scheduling_policy": sched.policy,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free,
            "kv_cache_usage": bm.num_used / bm.num_blocks,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "preempted_waiting": sched.num_preempted_waiting,
            "preemptions": sched.num_preemptions,
            "interrupted": sched.num_interrupted,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "prefix_cache_host_hit_tokens": bm.host_hit_tokens,
            "prefix_cache_ttl": bm.prefix_cache_ttl,
            "prefix_cache_expired_blocks": bm.expired_blocks,
            "host_tier": ("off (CPU engine: the KV cache is in host memory)" if self.runner.device.type == "cpu"
                          and host is None else "off" if host is None else f"{host.num_blocks} blocks"),
            "host_blocks_cached": len(host.cached) if host is not None else 0,
            "swapped_out_blocks": bm.swapped_out,
            "swapped_in_blocks": bm.swapped_in,
            **self.runner.memory_report(),
        }
