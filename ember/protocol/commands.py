"""What a client sends the engine core's loop, and the answer to a utility call. One record per command, no
closures or live objects, so the same commands can cross a pipe to a core in another process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.protocol.info import ModelInfo
from ember.protocol.outputs import EngineOutput
from ember.protocol.requests import EngineRequest


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Requests validated by the front end, queued together."""

    requests: tuple[EngineRequest, ...]


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class StopSample:
    """The front end found a stop string in this sample's text: finish it before the next step."""

    request_id: str
    index: int


@dataclass(frozen=True, slots=True)
class UtilityCall:
    """Run one of the core's utility methods (``EngineCore.UTILITIES``) by name between steps."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class UtilityResult:
    """A utility call's value, or the exception it raised (picklable: raised again in the caller)."""

    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the core (a core in its own process stops its ranks, then exits)."""


EngineCommand = AddRequests | AbortRequest | StopSample | UtilityCall | Shutdown


# --- what a core in its own process sends back (``ember.frontend.core_process``) ---

@dataclass(frozen=True, slots=True)
class CoreReady:
    """The core started: the model's facts, once."""

    model_info: ModelInfo


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One step's outputs (or an abort's)."""

    outputs: list[EngineOutput]


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core could not start, or stopped after an error: what happened (the exception when it pickles)."""

    message: str
    error: BaseException | None = None


CoreMessage = CoreReady | StepOutputs | UtilityResult | CoreFailed
