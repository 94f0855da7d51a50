"""TensorRT-LLM's multi-node launch (the reference page's "Multi-GPU multi-node (MGMN) support") on ember:
``trtllm-hlapi-launch`` and the worker node it starts on every rank but 0.

    srun --mpi=pmix ... trtllm-hlapi-launch python3 <your-python-script>.py
    mpirun -np 4 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 trtllm-hlapi-launch python3 <your-python-script>.py

As upstream's launcher, on MPI rank 0 (``PMIX_RANK``, else ``OMPI_COMM_WORLD_RANK``, else ember's launcher variables
``RANK`` / ``SLURM_PROCID``; none: not under a launcher) the command runs, once; every other rank runs ``python3 -m
ember.compat.tensorrt_llm.hlapi.mgmn_worker_node`` and serves. ember needs MASTER_ADDR / MASTER_PORT (rank 0's
machine and a free port), as for its other launched runs (docs/parallel.md).

How the ranks meet (ember/executor/launch_job.py): rank 0's launcher process holds a TCPStore at MASTER_ADDR:MASTER_PORT
for the whole job and runs the command with ``EMBER_LAUNCH_SHARED_STORE=1``. Each ``LLM(config)`` of the script whose
tp_size x pp_size is the launcher's world size (the "launched" executor) publishes its resolved rank settings there;
the worker nodes take them, join that engine's process group and serve it until it shuts down, then wait for the
next one. When the command ends, the launcher tells them, waits for them to leave, and exits with its exit code. An
``LLM`` with another size runs on its own (1 rank, or local ranks it spawns) while the workers wait.
"""

from __future__ import annotations

import logging
import os
import sys

from ember import envs
from ember.frontend.launch_job import hold_job, serve_job


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
    return hold_job(cmd, ids[1] or 1)


def main() -> int:
    """A worker node: serve each engine rank 0's script starts, until the launcher says the script ended."""
    ids = mpi_rank()
    if ids is None or envs.master_address() is None:
        print("mgmn_worker_node: run it under a launcher (its rank variables) with MASTER_ADDR and MASTER_PORT set; "
              "trtllm-hlapi-launch starts it on every rank but 0", file=sys.stderr)
        return 2
    rank, _, local_rank = ids
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    return serve_job(rank, local_rank)


if __name__ == "__main__":
    sys.exit(main())
