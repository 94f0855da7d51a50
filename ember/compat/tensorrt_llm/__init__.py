"""TensorRT-LLM's high-level API (the HLAPI of v0.8-0.9) on ember: scripts written for it run with
``tensorrt_llm`` replaced by ``ember.compat.tensorrt_llm`` in their imports. A thin translation onto the native
engine; docs/tensorrt_llm.md maps every name."""

from ember.compat.tensorrt_llm.hlapi import (
                                             LLM,
                                             CapacitySchedulerPolicy,
                                             GenerationOutput,
                                             GenerationResult,
                                             KvCacheConfig,
                                             ModelConfig,
                                             ParallelConfig,
                                             SamplingConfig,
                                             StreamingLLMParam,
)

__all__ = ["LLM", "CapacitySchedulerPolicy", "GenerationOutput", "GenerationResult", "KvCacheConfig",
           "ModelConfig", "ParallelConfig", "SamplingConfig", "StreamingLLMParam"]
