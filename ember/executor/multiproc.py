"""Ranks 1..N-1 as local processes the engine spawns and owns (the default for T x P > 1).

Each is ``python -m ember.executor.rank`` with its ``RankSpec`` pickled on stdin: a fresh interpreter that does
not re-run the user's script (as multiprocessing's spawn would), dies with its parent (PR_SET_PDEATHSIG), and
ignores Ctrl-C (rank 0 stops it). They meet rank 0 through a TCPStore on 127.0.0.1 that rank 0 opens on a free
port; tensors then travel over gloo (CPU) or NCCL (CUDA).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from ember.distributed import groups
from ember.executor.distributed import DistributedExecutor
from ember.executor.rank import rank_model_config

_JOIN_TIMEOUT_S = 10.0
RANK_COMMAND = [sys.executable, "-m", "ember.executor.rank"]  # reads its RankSpec, pickled, on stdin


class MultiprocExecutor(DistributedExecutor):
    def _start_ranks(self):
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, timeout=groups.timeout(),
                              wait_for_workers=False)
        env = dict(os.environ)
        threads = rank_model_config(self.resolved.model, 0, self._ranks_on_node()).num_threads
        if threads is not None:  # the rank's share of the cores, before its OpenMP starts
            env.setdefault("OMP_NUM_THREADS", str(threads))
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.world):
            proc = subprocess.Popen(RANK_COMMAND, stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            try:
                proc.stdin.write(pickle.dumps(self.spec(rank, "127.0.0.1", store.port, parent_pid=os.getpid())))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it ended already: the check-in wait reports how
        return store

    def _dead_ranks(self) -> list[str]:
        return [f"rank {i} (pid {p.pid}) exited with code {p.returncode}"
                for i, p in enumerate(getattr(self, "procs", []), start=1) if p.poll() is not None]

    def _stop_ranks(self) -> None:
        for proc in getattr(self, "procs", []):
            try:
                proc.wait(timeout=_JOIN_TIMEOUT_S if self.dead is None else 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
