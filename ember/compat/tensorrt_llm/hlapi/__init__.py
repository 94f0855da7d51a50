"""``tensorrt_llm.hlapi`` on ember: the HLAPI's LLM, its configs and results (docs/tensorrt_llm.md)."""

from ember.compat.tensorrt_llm.hlapi.config import (
                                                    CapacitySchedulerPolicy,
                                                    KvCacheConfig,
                                                    ModelConfig,
                                                    ParallelConfig,
                                                    StreamingLLMParam,
)
from ember.compat.tensorrt_llm.hlapi.llm import LLM
from ember.compat.tensorrt_llm.hlapi.result import GenerationOutput, GenerationResult
from ember.compat.tensorrt_llm.hlapi.sampling import SamplingConfig
from ember.compat.tensorrt_llm.quantization import QuantConfig

__all__ = ["LLM", "CapacitySchedulerPolicy", "GenerationOutput", "GenerationResult", "KvCacheConfig",
           "ModelConfig", "ParallelConfig", "QuantConfig", "SamplingConfig", "StreamingLLMParam"]
