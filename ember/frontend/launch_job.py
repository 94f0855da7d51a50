"""A job whose script runs once, on rank 0, while the other ranks serve the engines it starts: the front end's
door to ``ember.executor.launch_job`` for launchers (TensorRT-LLM's ``trtllm-hlapi-launch``)."""

from __future__ import annotations


def hold_job(cmd: list[str], world_size: int) -> int:
    """Rank 0: run cmd once as the job's script, serving its engines with the other ranks; its exit code."""
    from ember.executor.launch_job import hold_job as hold

    return hold(cmd, world_size)


def serve_job(rank: int, local_rank: int) -> int:
    """Any other rank: serve the engines of rank 0's script until it ends; 0, or 1 if serving one failed."""
    from ember.executor.launch_job import serve_job as serve

    return serve(rank, local_rank)
