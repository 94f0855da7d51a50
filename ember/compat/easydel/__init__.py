"""EasyDeL's vSurge API on ember: scripts written for it run with ``import easydel as ed`` replaced by
``import ember.compat.easydel as ed``. A thin translation onto the native engine; docs/easydel.md maps every name.
jax is optional (``pip install "ember[easydel]"``): jax dtypes and precisions are read by name, never imported."""

from ember.compat.easydel.api_server import vSurgeApiServer
from ember.compat.easydel.enums import (
    AttentionMechanisms,
    EasyDeLBackends,
    EasyDeLBaseConfigDict,
    EasyDeLGradientCheckPointers,
    EasyDeLPlatforms,
    EasyDeLQuantizationMethods,
    PartitionAxis,
)
from ember.compat.easydel.modeling import AutoEasyDeLModelForCausalLM, EasyDeLCausalLM
from ember.compat.easydel.outputs import ReturnSample
from ember.compat.easydel.sampling import GuidedDecodingParams, RequestOutputKind, SamplingParams
from ember.compat.easydel.surge import vSurge

__all__ = ["AttentionMechanisms", "AutoEasyDeLModelForCausalLM", "EasyDeLBackends", "EasyDeLBaseConfigDict",
           "EasyDeLCausalLM", "EasyDeLGradientCheckPointers", "EasyDeLPlatforms", "EasyDeLQuantizationMethods",
           "GuidedDecodingParams", "PartitionAxis", "RequestOutputKind", "ReturnSample", "SamplingParams", "vSurge",
           "vSurgeApiServer"]
