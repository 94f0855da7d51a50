"""The stop rules the engine core can see, written once for sampled tokens and beam candidates alike. Stop
*strings* need text: the front end checks them and finishes the sample through ``EngineCore.stop_sample``."""

from __future__ import annotations

from ember.protocol import FinishReason
from ember.sampling_params import SamplingParams

Stop = tuple[FinishReason, "int | list[int] | None"]  # (finish reason, the stop token or token sequence)


def check_stop(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int, max_model_len: int) -> Stop | None:
    """Whether the sample whose tokens (prompt + output, the newest token last) are ``token_ids`` ends here: EOS
    (unless ignore_eos), a stop token id or token sequence (within the output, once min_tokens are out), max_tokens
    or max_model_len."""
    n_out = len(token_ids) - num_prompt_tokens
    token = token_ids[-1]
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token in params.eos_token_ids:
            return FinishReason.STOP, None
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        for stop in params.stop_token_sequences:
            if len(stop) <= n_out and token_ids[len(token_ids) - len(stop):] == stop:
                return FinishReason.STOP, stop
    if (params.max_tokens is not None and n_out >= params.max_tokens) or len(token_ids) >= max_model_len:
        return FinishReason.LENGTH, None
    return None
