"""What a client sends the engine core's loop, and the answer to a utility call. One record per command, no
closures or live objects, so the same commands can cross a pipe to a core in another process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


EngineCommand = AddRequests | AbortRequest | StopSample | UtilityCall
