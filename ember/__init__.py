"""ember: a small, fast LLM inference engine with a vLLM-style API.

The names below, and the submodules as attributes (``ember.errors``), load on first use (PEP 562, as vLLM's package
does): ``import ember`` alone imports neither torch nor the engine, so the ``ember`` command can set the interpreter
up before they load (entrypoints/console.py)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ember.version import __version__

if TYPE_CHECKING:
    from ember.entrypoints.async_llm import AsyncLLM
    from ember.entrypoints.llm import LLM
    from ember.errors import BadRequestError, ConfigError, DoesNotFitError, EmberError, EngineDeadError
    from ember.lora.request import LoRARequest
    from ember.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
    from ember.protocol import PoolingParams
    from ember.sampling_params import GuidedDecodingParams, OutputKind, SamplingParams, StructuredOutputsParams

_MODULES = {"AsyncLLM": "ember.entrypoints.async_llm", "LLM": "ember.entrypoints.llm",
            **dict.fromkeys(("BadRequestError", "ConfigError", "DoesNotFitError", "EmberError", "EngineDeadError"),
                            "ember.errors"),
            "LoRARequest": "ember.lora.request",
            **dict.fromkeys(("CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "Logprob",
                             "RequestOutput"), "ember.outputs"),
            "PoolingParams": "ember.protocol",
            **dict.fromkeys(("GuidedDecodingParams", "OutputKind", "SamplingParams", "StructuredOutputsParams"),
                            "ember.sampling_params")}

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "OutputKind",
           "LoRARequest", "RequestOutput", "PoolingParams", "EmbeddingRequestOutput",
           "EmbeddingOutput", "CompletionOutput", "Logprob", "EmberError", "BadRequestError",
           "ConfigError", "DoesNotFitError", "EngineDeadError", "__version__"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value
    # a submodule, reachable as an attribute as when this package imported the engine eagerly (ember.errors, ...)
    if not name.startswith("_") and importlib.util.find_spec(f"ember.{name}") is not None:
        return importlib.import_module(f"ember.{name}")  # the import sets the attribute
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
