"""What the engine core answers each step: one ``EngineOutput`` per request that changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.protocol.status import FinishReason


@dataclass(slots=True)
class TokenLogprobs:
    """A scored token: its logprob and rank (1 = most likely), and the top alternatives, best first."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampleOutput:
    """One sample's progress in one step."""

    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    finish_reason: FinishReason | None = None  # set in the step it finished
    stop_reason: int | list[int] | None = None  # the stop token id or token sequence that ended it
    cumulative_logprob: float | None = None  # a finished beam's summed logprob (beam search reports no per-token ones)
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for this sample this step, and those kept
    num_accepted_draft_tokens: int = 0


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
    pooled: list[float] | None = None  # a pooling request's vector (float32 values), in the step it finished
    error: str | None = None  # the request could not be run (its adapter could not be read): why; it has ended

    def sample(self, index: int) -> SampleOutput:
        for s in self.samples:
            if s.index == index:
                return s
        s = SampleOutput(index)
        self.samples.append(s)
        return s
