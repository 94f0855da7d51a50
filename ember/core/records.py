"""The plain records the engine core takes and gives: picklable, no tokenizer, no callback, no tensor.

A front end turns a prompt into an ``EngineRequest``; each step the core answers with one ``EngineOutput`` per
request that changed (new tokens, logprobs, finish reasons, prefix-cache counts). ``ModelInfo`` is what a client
may know about the loaded engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.layers.sampler import TokenLogprobs
from ember.lora.request import LoRARequest
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


@dataclass(slots=True)
class SampleOutput:
    """One sample's progress in one step."""

    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    finish_reason: str | None = None  # set in the step it finished: "stop" | "length" | "abort" | "interrupted"
    stop_reason: int | list[int] | None = None  # the stop token id or token sequence that ended it
    cumulative_logprob: float | None = None  # a finished beam's summed logprob (beam search reports no per-token ones)


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    samples: list[SampleOutput] = field(default_factory=list)
    # prompt logprobs computed this step, for prompt positions prompt_logprobs_start + 1 ...; a recompute after a
    # preemption starts again at 0; prompt_logprobs_done: the whole prompt is scored
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    prompt_logprobs_done: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache (both tiers), once known
    num_host_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    def sample(self, index: int) -> SampleOutput:
        for s in self.samples:
            if s.index == index:
                return s
        s = SampleOutput(index)
        self.samples.append(s)
        return s


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    scheduling_policy: str
    kv_cache_dtype: str
    quantization: str | None  # the weight layout, described; None: float weights
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    executor: str = "uni"  # how the ranks run (EngineConfig.distributed_executor_backend, resolved)
    attention_window: int | None = None  # StreamingLLM: KV tokens a sequence keeps (sinks included); None: all
    sink_tokens: int = 0
    max_loras: int = 0  # adapters resident at once (0: LoRA off)
    max_lora_rank: int = 0
