"""Every rank started by a launcher (torchrun, mpirun, srun) that sets its rank, the world size and MASTER_ADDR /
MASTER_PORT. Each process runs the user's script; on rank 0 ``LLM(...)`` builds the engine, on the others it
serves rank 0's engine and, when rank 0 shuts it down, ends the process, as TensorRT-LLM's MPI launcher does."""

from __future__ import annotations

import sys

from ember.config import ResolvedConfig
from ember.executor.distributed import DistributedExecutor
from ember.executor.rank import RankSpec, run_rank
from ember.model_loader import check_parallel


class LaunchedExecutor(DistributedExecutor):
    def _start_ranks(self):
        return None  # the launcher started them; every rank meets at MASTER_ADDR:MASTER_PORT


def serve_launched(resolved: ResolvedConfig) -> None:
    par = resolved.parallel
    # the sizes rank 0 refuses are refused here too, before joining: no rank waits for a rank 0 that left
    check_parallel(resolved.model, par.tensor_parallel_size, par.pipeline_parallel_size, par.ranks_here)
    run_rank(RankSpec(par.rank, par.local_rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                      resolved.model, resolved.cache, None, None, par.ranks_here))
    sys.exit(0)
