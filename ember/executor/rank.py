"""A rank other than 0: join the groups, build its worker, then serve rank 0's calls until told to stop.

Every executor's other ranks run ``run_rank``: spawned processes (``python -m ember.executor.rank``, their
``RankSpec`` pickled on stdin), launched processes, Ray actors. Calls arrive as one broadcast object each
(``(method, args)``) on the control group; ``execute_model`` on the sampling rank sends its output back to rank 0,
any other call's result is gathered to rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
from dataclasses import dataclass

from ember.config import CacheConfig, ModelConfig
from ember.distributed import ParallelContext, groups

logger = logging.getLogger("ember")
STOP = "stop"


@dataclass(frozen=True, slots=True)
class RankSpec:
    rank: int
    local_rank: int
    tp_size: int
    pp_size: int
    model: ModelConfig
    cache: CacheConfig
    store_host: str | None  # rank 0's TCPStore; None: the launcher's MASTER_ADDR / MASTER_PORT
    store_port: int | None
    ranks_on_node: int  # ranks sharing this machine's cores (CPU: each takes its share of the threads)
    parent_pid: int = 0  # a spawned rank's parent: if it is gone by the time the rank reads this, the rank ends


def checked_in(rank: int) -> str:
    return f"ember/checked-in/{rank}"


def rank_model_config(model: ModelConfig, local_rank: int, ranks_on_node: int) -> ModelConfig:
    """A rank's own device (cuda:LOCAL_RANK) and, on CPU, its share of the engine's threads on this machine
    (num_threads, else every core)."""
    changes: dict = {}
    if model.device.startswith("cuda"):
        changes["device"] = f"cuda:{local_rank}"
    elif ranks_on_node > 1:
        changes["num_threads"] = max(1, (model.num_threads or os.cpu_count() or 1) // ranks_on_node)
    if changes and model.draft is not None:  # the draft model runs beside the rank's share, on its device
        changes["draft"] = dataclasses.replace(model.draft, **changes)
    return dataclasses.replace(model, **changes) if changes else model


def join(spec: RankSpec, store=None) -> ParallelContext:
    """Connect to rank 0 and build the groups (collective: every rank calls it); store: rank 0's store when the
    caller holds it already (a launched job's engine), else the spec's or the launcher's."""
    if store is None and spec.store_host is not None:
        import torch.distributed as dist

        store = dist.TCPStore(spec.store_host, spec.store_port, spec.tp_size * spec.pp_size, is_master=False,
                              timeout=groups.timeout())
    if store is not None:
        store.set(checked_in(spec.rank), "1")  # rank 0 waits for these, watching that no rank died first
    if spec.model.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(spec.local_rank)
    return groups.init(spec.rank, spec.tp_size, spec.pp_size, spec.model.device.split(":")[0], store)


def serve(worker, ctx: ParallelContext) -> None:
    """Run rank 0's calls until it says stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
        method, args = box[0]
        if method == STOP:  # acknowledged, so that no rank leaves the group while another still talks on it
            dist.gather_object(None, None, dst=0, group=ctx.control_group)
            return
        result = getattr(worker, method)(*args)
        if method != "execute_model":
            dist.gather_object(result, None, dst=0, group=ctx.control_group)
        elif ctx.is_sampler:
            dist.send_object_list([result], dst=0, group=ctx.control_group)


def run_rank(spec: RankSpec, store=None) -> None:
    """Join (through store when given, see join), load this rank's share of the model, serve, leave."""
    from ember.worker.worker import Worker

    ctx = join(spec, store)
    try:
        worker = Worker(rank_model_config(spec.model, spec.local_rank, spec.ranks_on_node), spec.cache, ctx)
        serve(worker, ctx)
    finally:
        groups.destroy()


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that spawned it ends, however it ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    try:
        spec = pickle.load(sys.stdin.buffer)
    except EOFError:  # the parent ended before it wrote the spec
        return 1
    if spec.parent_pid and os.getppid() != spec.parent_pid:  # it ended before PR_SET_PDEATHSIG took hold
        return 1
    logging.basicConfig(level=logging.WARNING, format=f"[rank {spec.rank}] %(levelname)s %(message)s")
    try:
        run_rank(spec)
    except Exception:
        logger.exception("rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
