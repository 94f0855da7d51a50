"""ember's exceptions. Each message names the field, the value and the allowed range.

The ones about input subclass ``ValueError``, which is what users of ember (and of vLLM) already catch.
"""

from __future__ import annotations


class EmberError(Exception):
    """Base of every error ember raises on purpose."""


class ConfigError(EmberError, ValueError):
    """An engine setting (argument or environment variable) is out of range; raised before the model loads."""


class BadRequestError(EmberError, ValueError):
    """A request's prompt or sampling parameters are invalid; raised in the caller's thread, nothing queued."""


class DoesNotFitError(EmberError, ValueError):
    """The model, the KV pool or a request does not fit the memory it was given."""


class EngineDeadError(EmberError, RuntimeError):
    """The engine loop stopped (shut down, or after an error): no request can be served any more."""


class RequestFailedError(EmberError, RuntimeError):
    """One request could not be run (its LoRA adapter's files could not be read when it was scheduled); the engine
    goes on serving the others, and a later request reads the adapter again."""
