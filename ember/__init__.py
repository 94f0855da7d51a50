"""ember: a small, fast LLM inference engine with a vLLM-style API."""

from ember.entrypoints.async_llm import AsyncLLM
from ember.entrypoints.llm import LLM
from ember.errors import BadRequestError, ConfigError, DoesNotFitError, EmberError, EngineDeadError
from ember.lora.request import LoRARequest
from ember.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from ember.protocol import PoolingParams
from ember.sampling_params import GuidedDecodingParams, OutputKind, SamplingParams, StructuredOutputsParams
from ember.version import __version__

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "OutputKind",
           "LoRARequest", "RequestOutput", "PoolingParams", "EmbeddingRequestOutput",
           "EmbeddingOutput", "CompletionOutput", "Logprob", "EmberError", "BadRequestError",
           "ConfigError", "DoesNotFitError", "EngineDeadError", "__version__"]
