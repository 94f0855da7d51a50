"""One status a sample has in the engine core, and the finish reasons it maps to once (vLLM's ``RequestStatus``)."""

from __future__ import annotations

from enum import Enum


class FinishReason(str, Enum):
    """Why a sample ended, as OpenAI and vLLM name it; a ``str``, so ``reason == "stop"`` holds."""

    STOP = "stop"  # EOS, a stop token id, token sequence or string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the caller aborted, or its stream was left
    INTERRUPTED = "interrupted"  # the scheduling policy gave it up (DashInfer's GenerateInterrupted); tokens kept
    ERROR = "error"  # the engine could not run it (its adapter could not be read); the others go on

    def __str__(self) -> str:
        return self.value


class RequestStatus(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_INTERRUPTED = "finished_interrupted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON_OF.get(self)

    @staticmethod
    def finished(reason: FinishReason) -> RequestStatus:
        return _STATUS_OF[reason]


_REASON_OF = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
              RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
              RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
              RequestStatus.FINISHED_INTERRUPTED: FinishReason.INTERRUPTED,
              RequestStatus.FINISHED_ERROR: FinishReason.ERROR}
_STATUS_OF = {reason: status for status, reason in _REASON_OF.items()}
