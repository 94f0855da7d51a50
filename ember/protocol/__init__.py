"""The records and enums that cross a layer: what the front end sends the engine core, what the core answers, what
the core sends its workers each step and what they answer. Plain, typed, picklable; no torch, no layer imported
(``tests/unit/test_architecture.py`` checks both), so a front end in another process, a rank, or a test with a fake
executor speaks them without the engine."""

from ember.protocol.batch import (
                                  DRAFT_PLACEHOLDER,
                                  BlockCopy,
                                  CopyKind,
                                  LoRALoad,
                                  NewSequence,
                                  PromptLogprobsRows,
                                  SamplingRow,
                                  SchedulerOutput,
                                  TokenMaskSource,
                                  WorkerOutput,
)
from ember.protocol.commands import (
                                     AbortRequest,
                                     AddRequests,
                                     CoreFailed,
                                     CoreMessage,
                                     CoreReady,
                                     EngineCommand,
                                     Shutdown,
                                     StepOutputs,
                                     StopSample,
                                     UtilityCall,
                                     UtilityResult,
)
from ember.protocol.info import ModelInfo
from ember.protocol.multimodal import MultiModalInput, Placeholder
from ember.protocol.outputs import EngineOutput, SampleOutput, TokenLogprobs
from ember.protocol.pooling import POOLING_TYPES, PoolingParams
from ember.protocol.requests import EngineRequest
from ember.protocol.stats import EngineStats, SchedulerStats, WorkerStats
from ember.protocol.status import FinishReason, RequestStatus
from ember.protocol.window import KVWindow
from ember.protocol.worker import PoolPlan, WorkerInfo

__all__ = ["DRAFT_PLACEHOLDER", "AbortRequest", "AddRequests", "BlockCopy", "CopyKind", "CoreFailed", "CoreMessage",
           "CoreReady", "EngineCommand", "EngineOutput", "EngineRequest", "EngineStats", "FinishReason", "KVWindow",
           "LoRALoad", "ModelInfo", "MultiModalInput", "NewSequence", "Placeholder", "POOLING_TYPES", "PoolPlan",
           "PoolingParams", "PromptLogprobsRows", "RequestStatus", "SampleOutput",
           "SamplingRow", "SchedulerOutput", "SchedulerStats", "Shutdown", "StepOutputs", "StopSample",
           "TokenLogprobs", "TokenMaskSource", "UtilityCall", "UtilityResult", "WorkerInfo", "WorkerOutput",
           "WorkerStats"]
