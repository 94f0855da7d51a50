"""What tests that look inside an engine reach through, in one place: the engine core and rank 0's worker of an
engine running in this process (``LLM``, ``AsyncLLM`` or an ``EngineClient``). Front ends never use these: the
client's door is ``ember.frontend.client.EngineClient``."""

from __future__ import annotations

from typing import Any


def core_of(engine: Any):
    """The ``EngineCore`` behind an in-process engine."""
    client = getattr(engine, "client", engine)
    return client._loop.core


def worker_of(engine: Any):
    """Rank 0's ``Worker`` (in this process for every executor)."""
    return core_of(engine).executor._worker
