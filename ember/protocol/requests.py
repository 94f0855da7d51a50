"""What the front end sends the engine core for one request: its token ids and checked parameters."""

from __future__ import annotations

from dataclasses import dataclass

from ember.lora.request import LoRARequest
from ember.protocol.multimodal import MultiModalInput
from ember.protocol.pooling import PoolingParams
from ember.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated, eos_token_ids filled in
    max_num_tokens: int  # prompt + max_tokens, capped by max_model_len
    cache_salt: str | None = None  # extra prefix-cache key (the adapter's id)
    grammar: str | None = None  # structured output: the llguidance grammar text the front end compiled
    lora: LoRARequest | None = None  # the adapter the request runs with (checked by the front end); None: base
    # one sample of an n > 1 request (``frontend.parallel_sampling``): the parent's id. The group's first request
    # computes the prompt; the others start from its full blocks.
    prefix_group: str | None = None
    # OpenAI's predicted outputs: text the answer is expected to repeat, tokenized; drafts come from it first
    prediction_token_ids: list[int] | None = None
    # a pooling (embedding) request: prefilled only, its pooled hidden state returned when the last prompt token is
    # computed; no token is sampled (params is then unused). Every field filled by the front end
    pooling: PoolingParams | None = None
    # images in the prompt (a vision-language model), in prompt order; their placeholder tokens are in
    # prompt_token_ids, their content hashes key the prefix cache of the blocks they cover
    mm_inputs: tuple[MultiModalInput, ...] = ()
