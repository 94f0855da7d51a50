"""TensorRT-LLM's multi-node launch (the reference page's "Multi-GPU multi-node (MGMN) support") on ember:
``trtllm-hlapi-launch`` and the worker node it starts on every rank but 0.

    srun --mpi=pmix ... trtllm-hlapi-launch python3 <your-python-script>.py
    mpirun -np 4 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 trtllm-hlapi-launch python3 <your-python-script>.py

As upstream's launcher, on MPI rank 0 (``PMIX_RANK``, else ``OMPI_COMM_WORLD_RANK``, else ember's launcher variables
``RANK`` / ``SLURM_PROCID``; none: not under a launcher) the command runs, once; every other rank runs ``python3 -m
ember.compat.tensorrt_llm.hlapi.mgmn_worker_node`` and serves. ember needs MASTER_ADDR / MASTER_PORT (rank 0's
machine and a free port), as for its other launched runs (docs/parallel.md).

How the ranks meet (ember/executor/launched.py): rank 0's launcher process holds a TCPStore at MASTER_ADDR:MASTER_PORT
for the whole job and runs the command with ``EMBER_LAUNCH_SHARED_STORE=1``. Each ``LLM(config)`` of the script whose
tp_size x pp_size is the launcher's world size (the "launched" executor) publishes its resolved rank settings there;
the worker nodes take them, join that engine's process group and serve it until it shuts down, then wait for the
next one. When the command ends, the launcher tells them, waits for them to leave, and exits with its exit code. An
``LLM`` with another size runs on its own (1 rank, or local ranks it spawns) while the workers wait.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time

from ember import envs
from ember.executor.launched import DONE, ENGINES, EXITED, SHARED_STORE, engine_key, engine_store, shared_store

logger = logging.getLogger("ember")
_POLL_S = 0.05
_LEAVE_TIMEOUT_S = 60.0  # how long the launcher waits for the worker nodes to leave after the command ended


def mpi_rank() -> tuple[int, int | None, int] | None:
    """(rank, world size or None, local rank): PMIX_RANK, else OMPI_COMM_WORLD_RANK (upstream's order), else ember's
    launcher variables (RANK / OMPI_COMM_WORLD_* / SLURM_*); None outside a launcher."""
    ids = envs.launcher_rank()
    for name in ("PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        raw = os.environ.get(name)
        if raw:
            return int(raw), ids[1] if ids else None, ids[2] if ids else 0
    return ids


def launch(argv: list[str] | None = None) -> int:
    """``trtllm-hlapi-launch COMMAND...``: the command on rank 0, a worker node on the others."""
    cmd = list(sys.argv[1:] if argv is None else argv)
    if not cmd or cmd[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if cmd else 2
    ids = mpi_rank()
    if ids is not None and ids[0] != 0:
        os.execv(sys.executable, [sys.executable, "-m", __name__])  # does not return
    if ids is None or ids[1] == 1:  # not under a launcher, or alone: nothing to serve
        os.execvp(cmd[0], cmd)
    if envs.master_address() is None:
        print("trtllm-hlapi-launch: set MASTER_ADDR and MASTER_PORT (rank 0's machine and a free port) on every rank",
              file=sys.stderr)
        return 2
    store = shared_store(is_master=True)
    store.add(ENGINES, 0)
    store.add(EXITED, 0)
    code = 1
    try:
        code = subprocess.run(cmd, env={**os.environ, SHARED_STORE: "1"}).returncode
    finally:
        store.set(DONE, str(code))
        if ids[1]:
            deadline = time.monotonic() + _LEAVE_TIMEOUT_S
            while store.add(EXITED, 0) < ids[1] - 1 and time.monotonic() < deadline:
                time.sleep(_POLL_S)
    return code


def _serve(spec, rank: int, local_rank: int, store) -> None:
    """One engine: check in, join its groups, build this rank's worker, serve until rank 0 stops it (as
    ember.executor.rank.run_rank does for a spawned rank, through the engine's own store)."""
    from ember.distributed import groups
    from ember.executor.rank import checked_in, rank_model_config, serve
    from ember.worker.worker import Worker

    store.set(checked_in(rank), "1")
    if spec.model.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(local_rank)
    ctx = groups.init(rank, spec.tp_size, spec.pp_size, spec.model.device.split(":")[0], store)
    try:
        ranks_here = envs.local_world_size() or spec.ranks_on_node
        worker = Worker(rank_model_config(spec.model, local_rank, ranks_here), spec.cache, ctx)
        serve(worker, ctx)
    finally:
        groups.destroy()


def main() -> int:
    """A worker node: serve each engine rank 0's script starts, until the launcher says the script ended."""
    ids = mpi_rank()
    if ids is None or envs.master_address() is None:
        print("mgmn_worker_node: run it under a launcher (its rank variables) with MASTER_ADDR and MASTER_PORT set; "
              "trtllm-hlapi-launch starts it on every rank but 0", file=sys.stderr)
        return 2
    rank, _, local_rank = ids
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    store = shared_store()
    failed, n = False, 1
    while True:
        key = engine_key(n)
        while not store.check([key]) and not store.check([DONE]):
            time.sleep(_POLL_S)
        if not store.check([key]):  # the script ended (it published no engine since)
            break
        try:
            _serve(pickle.loads(store.get(key)), rank, local_rank, engine_store(store, n))
        except Exception:
            logger.exception("rank %d failed serving engine %d", rank, n)
            failed = True
        n += 1
    store.add(EXITED, 1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
