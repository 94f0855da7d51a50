"""What the engine core sends its workers each step, and what comes back: plain lists and numbers, picklable.

``SchedulerOutput`` is exactly what a tensor-parallel broadcast or a pipeline stage carries: a sequence's tokens,
blocks and sampling parameters go out once, then only what changes (vLLM v1's ``SchedulerOutput`` does the same);
each worker's model runner keeps the rest. The one field that is not plain data is ``token_masks`` (structured
output): a handle whose bitmask is filled while the model runs and sent filled when pickled. ``SamplingRow`` and
``PromptLogprobsRows`` are what a runner hands its sampler, built from what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ember.protocol.multimodal import MultiModalInput, Placeholder
from ember.protocol.outputs import TokenLogprobs
from ember.protocol.pooling import PoolingParams
from ember.sampling_params import SamplingParams


class CopyKind(str, Enum):
    SWAP_OUT = "out"  # device -> host (the host tier keeps an evicted prefix block)
    SWAP_IN = "in"  # host -> device (a prefix hit on the host tier)
    COPY = "copy"  # device -> device (a beam's partial block, copied on write)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One KV block copy the block manager queued; the worker runs a step's copies in order, before its forward."""

    kind: CopyKind
    src: int
    dst: int


@dataclass(slots=True)
class PromptLogprobsRows:
    """Rows start..start+len(targets)-1 score the prompt tokens ``targets`` (the top k of each too)."""

    handle: int
    start: int
    targets: list[int]
    k: int


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """Read the PEFT adapter at ``path`` into slot ``slot`` of every projection (replacing what was there)."""

    slot: int
    path: str


@dataclass(slots=True)
class SamplingRow:
    """One row to sample this step."""

    handle: int  # the sample's id: keys its sampling state in the worker
    params: SamplingParams
    # the sample's own seed (params.seed + its index); None: the sampler's own generator (the engine's seed)
    seed: int | None
    num_output_tokens: int
    token_ids: list[int] | None = None  # prompt + output, sent only to rows whose processors read the history
    num_prompt_tokens: int = 0
    # a row verifying a draft: the last num_draft of token_ids are drafted tokens before this position, not kept
    # yet, so the processors' state between steps (counts, n-gram index, thinking scan) does not take them in
    num_draft: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @staticmethod
    def reads_history(params: SamplingParams) -> bool:
        return params.needs_penalties or params.bans_tokens or params.thinking_token_budget is not None


class TokenMaskSource(Protocol):
    """The guided sampling rows' allowed tokens (``ember.worker.token_masks.TokenMasks``): ``rows`` index the
    batch's sampling rows; ``get`` waits for the bitmask (int32 [len(rows), ceil(V / 32)]) and returns it."""

    rows: list[int]
    waited: float

    def get(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the workers do not hold (just admitted, a forked sample or beam, or resumed after a preemption):
    everything about it, once. Later steps send only what changed (``SchedulerOutput``)."""

    handle: int  # the sample's id: keys its state in the workers
    token_ids: list[int]  # prompt + what it generated so far
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is already in the cache (a prefix hit, a fork's shared blocks)
    block_ids: list[int]
    params: SamplingParams
    seed: int | None  # the sample's own seed (params.seed + its index); None: the sampler's own generator
    lora_slot: int = -1  # the adapter's slot, -1 for the base model
    prompt_logprobs: int | None = None  # k: score the prompt tokens it computes (the top k of each too)
    pooling: PoolingParams | None = None  # a pooling request: pool its prompt's hidden states, sample nothing
    placeholders: tuple[Placeholder, ...] = ()  # its prompt's image positions: they take the encoder's embeddings


DRAFT_PLACEHOLDER = -1  # a draft token the worker's draft model fills in the step (``SchedulerOutput.draft_token_ids``)


@dataclass(slots=True)
class SchedulerOutput:
    """One step, as the core sends it to every worker: new sequences in full, the others as diffs (tokens and KV
    blocks appended since the last step they ran in), then which sequences run and how many tokens each computes.
    Rows are ordered decodes first, then prefill chunks and rows verifying a draft. A worker applies ``finished``
    and ``preempted`` first, then ``new`` and the diffs; a sequence's computed tokens advance by what it ran, which
    the core counts alike (a verified draft's: by the core's ``num_computed_tokens`` when it next runs)."""

    new: list[NewSequence] = field(default_factory=list)
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)  # handle -> tokens appended (sampled, a beam's)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # handle -> blocks appended to its table
    # speculative decoding: handle -> the draft its row verifies after its last token (the row computes 1 + len
    # tokens and samples each; only the last token counts as computed until the core says what was kept). A draft
    # of placeholders (-1) is the worker's draft model's to fill (``WorkerOutput.drafts`` says with what)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # handle -> tokens of its own to feed the draft model's KV this step, which it lacks (a new sequence's prompt,
    # spread over steps before its first draft)
    draft_catch_up: dict[int, int] = field(default_factory=dict)
    # handle -> its computed tokens, sent when the core's count is not what the worker can know (a verified draft:
    # the kept tokens' KV stays, the rest is overwritten later)
    num_computed_tokens: dict[int, int] = field(default_factory=dict)
    handles: list[int] = field(default_factory=list)  # the sequences this step runs, in row order
    num_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    finished: list[int] = field(default_factory=list)  # drop the sequence and its sampling state
    preempted: list[int] = field(default_factory=list)  # drop the sequence, keep its sampling state: it comes back new
    copies: list[BlockCopy] = field(default_factory=list)  # KV block copies, run first
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters to read into their slots before the step
    token_masks: TokenMaskSource | None = None  # structured output: the guided sampling rows' allowed tokens
    # vision-language models: images to encode before the forward (into the encoder cache, by hash), and cached
    # encodings to drop first; the core's ``EncoderCache`` mirrors what each worker holds
    encode: list[MultiModalInput] = field(default_factory=list)
    encoder_free: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WorkerOutput:
    token_ids: list[int]  # one per sampling row
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]]  # handle -> one per target token
    # beam-search rows: sampling row -> (token ids, log-probabilities) of its best continuations
    beams: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # a draft model's drafts: handle -> the tokens it drafted where the core sent placeholders (-1) to fill
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # pooling requests whose last prompt token this step computed: handle -> the pooled vector (float32 values)
    pooled: dict[int, list[float]] = field(default_factory=dict)
    # adapters this step's ``lora_loads`` could not read (folder removed or rewritten since it was accepted): slot ->
    # why; the slot is left empty and the core ends the requests that need it, not the engine
    lora_failures: dict[int, str] = field(default_factory=dict)
