"""Every rank started by a launcher (torchrun, mpirun, srun) that sets its rank, the world size and MASTER_ADDR /
MASTER_PORT. Each process runs the user's script; on rank 0 ``LLM(...)`` builds the engine, on the others it
serves rank 0's engine and, when rank 0 shuts it down, ends the process, as TensorRT-LLM's MPI launcher does.

In a job whose script runs on rank 0 only (``launch_job``: TensorRT-LLM's ``trtllm-hlapi-launch``), rank 0's launcher
holds a TCPStore at MASTER_ADDR:MASTER_PORT for the whole job and sets SHARED_STORE for the script; each engine the
script starts publishes its ``RankSpec`` there (numbered ``engine_key(n)``) and meets the other ranks under its own
key prefix, where they serve it."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys

from ember import envs
from ember.config import ResolvedConfig
from ember.distributed import groups
from ember.executor.distributed import DistributedExecutor
from ember.executor.rank import RankSpec, run_rank
from ember.model_loader import check_parallel

SHARED_STORE = envs.LAUNCH_SHARED_STORE  # "1": the launcher's rank 0 holds the job's store (see above)
ENGINES, DONE, EXITED = "ember/launch/engines", "ember/launch/done", "ember/launch/exited"


def left_key(rank: int) -> str:
    """Set when that rank of a torchrun-launched engine has left the group; per restart of the job (torchrun's
    agent keeps its store across ``--max-restarts``, so an earlier attempt's keys must not count)."""
    return f"ember/launch/left/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


logger = logging.getLogger("ember")


def engine_key(n: int) -> str:
    """Where engine n (from 1) of the script publishes its pickled RankSpec."""
    return f"ember/launch/engine/{n}"


def shared_store(is_master: bool = False):
    """The job's store at MASTER_ADDR:MASTER_PORT (a client connects once the master is up, within the timeout)."""
    import torch.distributed as dist

    addr, port = envs.master_address()
    return dist.TCPStore(addr, int(port), is_master=is_master, timeout=groups.timeout(), wait_for_workers=False)


def engine_store(store, n: int):
    """Engine n's view of the job's store: its own keys, so that engines started one after another do not meet."""
    import torch.distributed as dist

    return dist.PrefixStore(f"ember/launch/{n}/", store)


class LaunchedExecutor(DistributedExecutor):
    def _start_ranks(self):
        if os.environ.get(SHARED_STORE) != "1":
            return None  # the launcher started them; every rank meets at MASTER_ADDR:MASTER_PORT
        store = shared_store()  # trtllm-hlapi-launch: the other ranks wait for this engine's spec
        n = store.add(ENGINES, 1)
        store.set(engine_key(n), pickle.dumps(self.spec(0, None, None)))
        return engine_store(store, n)

    def _stop_ranks(self) -> None:
        """Stopped normally under a plain launcher: wait until every other rank has left the group. Besides ending
        together, the wait holds no GIL, so gloo's worker threads can free the last collectives' tensors (which
        takes the GIL) before this interpreter finalizes; a script that ended first aborted with "terminate called
        without an active exception" (once in ~20 runs under load: a gather's work freed during Py_Finalize)."""
        if os.environ.get(SHARED_STORE) == "1" or self.dead is not None or self.world == 1:
            return
        try:
            shared_store().wait([left_key(r) for r in range(1, self.world)], datetime.timedelta(seconds=30))
        except (RuntimeError, ValueError) as e:  # torch's DistStoreError is a RuntimeError
            logger.warning("the other ranks did not report leaving within 30 s: %s", e)


def serve_launched(resolved: ResolvedConfig) -> None:
    par = resolved.parallel
    # the sizes rank 0 refuses are refused here too, before joining: no rank waits for a rank 0 that left
    check_parallel(resolved.model, par.tensor_parallel_size, par.pipeline_parallel_size, par.ranks_here)
    run_rank(RankSpec(par.rank, par.local_rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                      resolved.model, resolved.cache, None, None, par.ranks_here))
    try:  # rank 0 waits for this before it leaves the group itself (LaunchedExecutor._stop_ranks)
        shared_store().set(left_key(par.rank), "1")
    except RuntimeError:
        pass  # rank 0's launcher is gone: nobody waits
    sys.exit(0)
