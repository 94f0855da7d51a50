"""``easydel.inference.sampling_params`` on ember: where EasyDeL scripts import ``GuidedDecodingParams`` from."""

from ember.compat.easydel.sampling import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["GuidedDecodingParams", "RequestOutputKind", "SamplingParams"]
