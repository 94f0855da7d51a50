"""What a request does with the rows it sampled, and how it ends: one interface for every way of decoding, so the
after-step work (``decoding.Decoding``) treats them alike. ``OneSample`` appends one token a step (or a verified
draft's kept tokens and one more); ``BeamSearch`` ranks its beams' continuations together."""

from __future__ import annotations

from typing import Protocol

from ember.core.request import CoreRequest, Sequence
from ember.protocol import EngineOutput, FinishReason, WorkerOutput


class DecodingStrategy(Protocol):
    def collect(self, seq: Sequence, row: int, result: WorkerOutput, outputs: dict[str, EngineOutput]) -> None:
        """seq sampled row ``row`` of the step's result: take its tokens (or candidates) and end what stops; what
        changed goes into the request's output in ``outputs``."""

    def end(self, req: CoreRequest, reason: FinishReason, out: EngineOutput) -> None:
        """End what is left of the request with reason (an abort; an interruption: the scheduler gave a sequence
        up and freed it), into out."""
