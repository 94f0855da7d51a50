"""A job whose script runs once, on rank 0, while every other rank serves the engines it starts (TensorRT-LLM's
multi-node launch, ``trtllm-hlapi-launch``; the store and the engines' side are in ``launched``).

``hold_job`` runs on rank 0: it holds the job's store at MASTER_ADDR:MASTER_PORT, runs the command with
SHARED_STORE set (so each launched ``LLM(...)`` publishes its rank settings there), marks the job done when the
command ends, waits for the other ranks to leave and returns the command's exit code. ``serve_job`` runs on every
other rank: it serves each published engine in turn (check in, join its groups, build this rank's worker, serve
until rank 0 stops it) until the job is done."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import time

from ember import envs
from ember.executor.launched import DONE, ENGINES, EXITED, SHARED_STORE, engine_key, engine_store, shared_store

logger = logging.getLogger("ember")
_POLL_S = 0.05
LEAVE_TIMEOUT_S = 60.0  # how long rank 0 waits for the other ranks to leave after the command ended


def hold_job(cmd: list[str], world_size: int) -> int:
    """Rank 0: run cmd once as the job's script; its exit code."""
    store = shared_store(is_master=True)
    store.add(ENGINES, 0)
    store.add(EXITED, 0)
    code = 1
    try:
        code = subprocess.run(cmd, env={**os.environ, SHARED_STORE: "1"}).returncode
    finally:
        store.set(DONE, str(code))
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while store.add(EXITED, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return code


def serve_job(rank: int, local_rank: int) -> int:
    """Every other rank: serve each engine rank 0's script starts, until the job is done; 1 if one failed here."""
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


def _serve(spec, rank: int, local_rank: int, store) -> None:
    """One engine, as ``rank.run_rank`` serves any rank, through the engine's own store."""
    from ember.executor.rank import run_rank

    run_rank(dataclasses.replace(spec, rank=rank, local_rank=local_rank,
                                 ranks_on_node=envs.local_world_size() or spec.ranks_on_node), store)
