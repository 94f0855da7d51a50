"""What a request returns: vLLM's RequestOutput / CompletionOutput shapes.

The engine emits *deltas* (only what changed in one step); ``RequestOutput.merge`` folds them into the cumulative
view that ``LLM.generate`` and, by default, ``AsyncLLM.generate`` return.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the chosen (or prompt) token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # a ``FinishReason`` value: "stop" | "length" | "abort" | "interrupted"
    stop_reason: int | str | list[int] | None = None  # the stop token id, string or token sequence that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, delta: "CompletionOutput") -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # speculative decoding: tokens drafted for the request's samples and those kept (lookup, a draft model and a
    # prediction alike)
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # a request with a prediction, once finished (OpenAI's usage.completion_tokens_details): the prediction's tokens
    # that appear in the completion and those that do not, summed over the samples
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (both tiers)
    num_device_cached_tokens: int = 0  # ... found in device memory
    num_host_cached_tokens: int = 0  # ... copied back from the host tier (CUDA engines with cpu_cache_memory)

    def merge(self, delta: "RequestOutput") -> None:
        """Fold a later delta of the same request into this cumulative output."""
        by_index = {o.index: o for o in self.outputs}
        for d in delta.outputs:
            if d.index in by_index:
                by_index[d.index].merge(d)
            else:
                fresh = CompletionOutput(index=d.index)
                fresh.merge(d)
                self.outputs.append(fresh)
                by_index[d.index] = fresh
        self.outputs.sort(key=lambda o: o.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_device_cached_tokens = delta.num_device_cached_tokens
        self.num_host_cached_tokens = delta.num_host_cached_tokens


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the pooled vector (float32 values; empty when the request ended without one)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: one prompt's embedding. It comes once, finished; finish_reason "stop", or
    "abort" / "interrupted" with an empty embedding."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str = "stop"
    metrics: RequestMetrics | None = None
