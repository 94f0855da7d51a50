"""Rank 0 of a split model, in the engine's process: its own share of the model, and the calls to the other ranks.

A call is one broadcast of ``(method, args)`` on the control group (the step's ``SchedulerOutput`` for
``execute_model``: new sequences in full, then per step only what changed; every rank's model runner keeps the
sequences and builds its tensors from them); rank 0 then runs the
same method on its own worker. With several stages a step's sampled tokens come back from the sampling rank as one
object; any other call's results are gathered from every rank.
A rank that dies makes the next collective fail (gloo sees the connection close), which ends the engine with an
``EngineDeadError`` that says which rank died; subclasses start and stop the other ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ember.config import ResolvedConfig
from ember.distributed import ParallelContext, groups
from ember.distributed.comm import COMM
from ember.errors import EngineDeadError
from ember.executor.rank import STOP, RankSpec, checked_in, rank_model_config
from ember.protocol import SchedulerOutput, WorkerOutput
from ember.worker.worker import Worker


class DistributedExecutor:
    def __init__(self, resolved: ResolvedConfig) -> None:
        par = resolved.parallel
        self.resolved = resolved
        self.world = par.world_size
        self.dead: EngineDeadError | None = None
        self._closed = False
        self._threads = torch.get_num_threads()  # rank 0's worker takes its share of the cores; given back at close
        try:
            store = self._start_ranks()
            if store is not None:
                self._await_check_in(store)
            if resolved.model.device.startswith("cuda"):
                torch.cuda.set_device(par.local_rank)
            self.ctx: ParallelContext = groups.init(0, par.tensor_parallel_size, par.pipeline_parallel_size,
                                                    resolved.model.device.split(":")[0], store)
            model = rank_model_config(resolved.model, par.local_rank, self._ranks_on_node())
            self._worker = Worker(model, resolved.cache, self.ctx)
        except BaseException as e:
            raised = self._fail(e)
            self._close()
            if raised is e:
                raise
            raise raised from e

    # --- what subclasses provide ---
    def _start_ranks(self) -> Any:
        """Start ranks 1..world-1 (if this executor starts them); the store rank 0 joins through, or None."""
        raise NotImplementedError

    def _stop_ranks(self) -> None:
        """After the stop call (or a failure): make sure no rank this executor started is left."""

    def _dead_ranks(self) -> list[str]:
        """What is known of ranks that ended on their own, e.g. 'rank 1 (pid 123) exited with code -9'."""
        return []

    def dead_ranks(self) -> list[str]:
        """Ranks that ended on their own (the engine loop asks while it is idle, so that a rank killed between
        requests stops the engine at once rather than at the next request's step)."""
        return self._dead_ranks() if not self._closed else []

    def _ranks_on_node(self) -> int:
        """Ranks sharing this machine's cores (as if all, where a Ray cluster may spread them)."""
        return self.resolved.parallel.ranks_here or self.world

    def spec(self, rank: int, host: str | None, port: int | None, local_rank: int | None = None,
             parent_pid: int = 0) -> RankSpec:
        par = self.resolved.parallel
        return RankSpec(rank, rank if local_rank is None else local_rank, par.tensor_parallel_size,
                        par.pipeline_parallel_size, self.resolved.model, self.resolved.cache, host, port,
                        self._ranks_on_node(), parent_pid)

    def _await_check_in(self, store: Any) -> None:
        """Wait until every other rank reached the store; a rank that ends first fails the start at once (instead
        of rank 0 waiting out the timeout inside init_process_group)."""
        keys = [checked_in(r) for r in range(1, self.world)]
        deadline = time.monotonic() + groups.timeout().total_seconds()
        while not store.check(keys):
            died = self._dead_ranks()
            if died or time.monotonic() > deadline:
                what = "; ".join(died) if died else f"not all ranks joined within {groups.timeout()}"
                raise EngineDeadError(f"the split model could not start: {what}")
            time.sleep(0.05)

    # --- the executor ---
    def _call(self, method: str, args: tuple[Any, ...]) -> Any:
        """Run method on every rank: a step's output (from the sampling rank), or every rank's result, rank 0 first.
        Any failure ends the executor: a rank that died is named; rank 0's own error (a DoesNotFitError every rank
        raised alike, an out-of-memory) is raised as it is."""
        import torch.distributed as dist

        if self.dead is not None:
            raise self.dead
        try:
            dist.broadcast_object_list([(method, args)], src=0, group=self.ctx.control_group)
            result = getattr(self._worker, method)(*args)
            if method != "execute_model":
                results: list = [None] * self.world
                dist.gather_object(result, results, dst=0, group=self.ctx.control_group)
                return results
            if not self.ctx.is_sampler:
                start = time.perf_counter()  # rank 0 idles here while the later stages finish: the bubble
                box = [None]
                dist.recv_object_list(box, src=self.ctx.sampler_rank, group=self.ctx.control_group)
                COMM.add("result_wait", start)
                result = box[0]
            return result
        except BaseException as e:
            raised = self._fail(e)
            if raised is e:
                raise
            raise raised from e

    def _fail(self, error: BaseException) -> BaseException:
        """Mark the executor dead and return what to raise: an EngineDeadError naming the ranks that died (given a
        moment to be reaped: a peer's closed connection is seen before its exit), else rank 0's own error as it is
        (a DoesNotFitError every rank raised alike, an out-of-memory); later calls raise EngineDeadError."""
        if isinstance(error, EngineDeadError):  # already says what happened
            self.dead = error
            return error
        deadline = time.monotonic() + 1.0
        died = self._dead_ranks()
        while not died and isinstance(error, RuntimeError) and time.monotonic() < deadline:
            time.sleep(0.05)
            died = self._dead_ranks()
        stopped = "The engine has stopped; create a new one"
        if died:
            self.dead = EngineDeadError(f"a worker rank of the split model failed: {'; '.join(died)}. {stopped}")
        elif isinstance(error, RuntimeError) and "onnection" in str(error):  # gloo: "Connection closed by peer"
            self.dead = EngineDeadError(f"a worker rank of the split model failed: a collective failed ({error}). "
                                        f"{stopped}")
        else:
            self.dead = EngineDeadError(f"rank 0 of the split model failed: {error!r}. {stopped}")
            return error
        return self.dead

    def execute_model(self, batch: SchedulerOutput) -> WorkerOutput:
        return self._call("execute_model", (batch,))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._call(Worker.check_rpc(method), args)

    def shutdown(self) -> None:
        if self._closed:
            return
        died = self._dead_ranks()
        if self.dead is None and died:  # nobody to say stop to: leave the group at once
            self.dead = EngineDeadError(f"a worker rank of the split model failed: {'; '.join(died)}")
        if self.dead is None:
            try:
                import torch.distributed as dist

                dist.broadcast_object_list([(STOP, ())], src=0, group=self.ctx.control_group)
                # every rank has it before any leaves the group: a rank leaving with traffic still in flight on
                # gloo's pairs could abort its process ("terminate called without an active exception", seen once)
                dist.gather_object(None, [None] * self.world, dst=0, group=self.ctx.control_group)
            except RuntimeError:
                self.dead = EngineDeadError("a rank was gone at shutdown")
        self._close()

    def _close(self) -> None:
        """Stopped normally: wait for the ranks, then leave the group. Failed: leave the group first (its closed
        connections end ranks still waiting on rank 0), then end the ranks."""
        self._closed = True
        if self.dead is None:
            self._stop_ranks()
            groups.destroy()
        else:
            groups.destroy()
            self._stop_ranks()
        torch.set_num_threads(self._threads)
