"""An executor with no model: it answers the engine core as a worker would (``PoolPlan``, ``WorkerInfo``,
``WorkerOutput``) with tokens a script chooses. It holds the sequences and plans each step's rows as a model runner
does (``InputBatch``), and keeps every message and plan it saw. Over it the core's scheduling,
stop rules, n > 1, beam search, aborts and preemption are tested in milliseconds (``tests/unit``), and the core's
own cost a step is measured without a model's (``benchmarks/core_step.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.config import CacheConfig, ModelConfig, ParallelConfig, ResolvedConfig, SchedulerConfig
from ember.protocol import (
    PoolPlan,
    SamplingRow,
    SchedulerOutput,
    TokenLogprobs,
    WorkerInfo,
    WorkerOutput,
    WorkerStats,
)
from ember.worker.input_batch import InputBatch, StepRows

EOS = 2
VOCAB = 1000


def default_script(row: SamplingRow) -> int:
    """A token that depends only on the sample and how far it is: never EOS, so samples run to their length."""
    return 100 + (row.handle * 7 + row.num_output_tokens) % 500


class ScriptedExecutor:
    def __init__(self, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                 script: Callable[[SamplingRow], int] = default_script) -> None:
        self.plan = PoolPlan(num_blocks, num_host_blocks, block_size, 0, "scripted", 0)
        self.script = script
        self.keep = True  # False: keep no message nor plan (long measurements)
        self.messages: list[SchedulerOutput] = []
        self.steps: list[StepRows] = []  # the rows each step with sequences to run planned
        self.input_batch = InputBatch(block_size)
        self.live: set[int] = set()  # sample handles whose sampling state a worker would hold
        self.closed = False
        self.unreadable: set[str] = set()  # adapter paths whose loads fail (a folder removed after acceptance)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "init_cache":
            return [self.plan]
        if method == "info":
            return [WorkerInfo("Scripted", "float32", "cpu", VOCAB, None, kv_bytes_per_block=1024)]
        if method == "stats":
            return [WorkerStats("scripted", "none", 0, 0, 0, 0, 0)]
        if method == "report":
            return [{"rank": 0}]
        raise ValueError(f"collective_rpc: {method!r} is not a worker method the scripted executor answers; allowed: "
                         "init_cache, info, stats, report")

    def execute_model(self, message: SchedulerOutput) -> WorkerOutput:
        if self.keep:
            self.messages.append(message)
        self.live.difference_update(message.finished)
        self.input_batch.update(message)
        self.input_batch.take_table_writes()
        failures = {load.slot: f"lora adapter {load.path}: no such folder" for load in message.lora_loads
                    if load.path in self.unreadable}
        if not message.handles:
            return WorkerOutput([], [], {}, lora_failures=failures)
        batch = self.input_batch.plan(message)
        if self.keep:
            self.steps.append(batch)
        tokens, lps, beams = [], [], {}
        for i, row in enumerate(batch.sampling):
            self.live.add(row.handle)
            token = self.script(row)
            tokens.append(token)
            lps.append(TokenLogprobs(-1.0, 1, [token], [-1.0]) if row.params.logprobs is not None else None)
            if row.params.use_beam_search:  # candidates best first, scores a function of the token
                k = row.params.beam_candidates
                ids = [token + j for j in range(k)]
                beams[i] = (ids, [-0.1 * (j + 1) - 0.01 * (t % 7) for j, t in enumerate(ids)])
        prompt_lps = {rows.handle: [TokenLogprobs(-2.0, 1, [], []) for _ in rows.targets]
                      for rows in batch.prompt_logprobs}
        return WorkerOutput(tokens, lps, prompt_lps, beams, lora_failures=failures)

    def shutdown(self) -> None:
        self.closed = True


def scripted_configs(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, block_size: int = 16,
                     chunked_prefill: bool = True, prefix_caching: bool = True,
                     policy: str = "max_utilization") -> tuple[SchedulerConfig, ResolvedConfig]:
    """The settings an engine core over a ``ScriptedExecutor`` runs with: these limits, no checkpoint, one rank."""
    model = ModelConfig("scripted", None, "float32", "cpu", None, None, None, 0, None)
    cache = CacheConfig(block_size, "auto", None, None, "default", None, None, prefix_caching, None)
    sched = SchedulerConfig(max_num_seqs, max_model_len, max_num_batched_tokens, chunked_prefill, policy)
    return sched, ResolvedConfig(model, cache, ParallelConfig())
