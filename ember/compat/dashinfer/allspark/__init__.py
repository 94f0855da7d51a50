"""``allspark``: DashInfer's Python API on ember. Scripts written for ``from dashinfer import allspark`` run with
``from ember.compat.dashinfer import allspark`` instead.

- model_loader: HuggingFaceModel (read and serialize a checkpoint), DashInferModel (open a serialized one);
- runtime_config / generation_config: the two builders and their configs;
- engine: Engine (install / start / stop / release models; start, stop, sync, release requests);
- result_queue: ResultQueue and GeneratedElements; status: the enums.
"""

from ember.compat.dashinfer.allspark.engine import Engine
from ember.compat.dashinfer.allspark.generation_config import ASGenerationConfigBuilder
from ember.compat.dashinfer.allspark.model_loader import LLM, DashInferModel, HuggingFaceModel
from ember.compat.dashinfer.allspark.multimedia import MultiMediaInfo
from ember.compat.dashinfer.allspark.prompt_utils import PromptTemplate
from ember.compat.dashinfer.allspark.result_queue import GeneratedElements, RequestHandle, ResultQueue
from ember.compat.dashinfer.allspark.runtime_config import AsModelConfig, AsModelRuntimeConfigBuilder
from ember.compat.dashinfer.allspark.status import (AsCacheMode, AsException, AsStatus, GenerateRequestStatus,
                                                    ModelSerializerException, ModelState, RoPEScaleMethod,
                                                    TargetDevice)

__all__ = ["AsStatus", "AsModelConfig", "AsCacheMode", "Engine", "GenerateRequestStatus", "HuggingFaceModel",
           "DashInferModel", "AsModelRuntimeConfigBuilder", "ASGenerationConfigBuilder", "ResultQueue",
           "GeneratedElements", "RequestHandle", "TargetDevice", "RoPEScaleMethod", "ModelState", "AsException",
           "ModelSerializerException", "PromptTemplate", "LLM", "MultiMediaInfo"]
