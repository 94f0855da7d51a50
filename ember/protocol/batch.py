"""What the engine core sends its workers each step, and what comes back: plain lists and numbers, picklable.

This is exactly what a tensor-parallel broadcast or a pipeline stage carries; the worker builds every tensor from
it. Rows are ordered decodes first, then prefill chunks. The one field that is not plain data is ``token_masks``
(structured output): a handle whose bitmask is filled while the model runs and sent filled when pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ember.protocol.outputs import TokenLogprobs
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
class PrefillChunk:
    start: int  # first row of this sequence in the flat batch
    length: int  # query tokens this step
    context_len: int  # tokens in the cache after this step, these included
    block_table: list[int]


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

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @staticmethod
    def reads_history(params: SamplingParams) -> bool:
        return params.needs_penalties or params.bans_tokens


class TokenMaskSource(Protocol):
    """The guided sampling rows' allowed tokens (``ember.worker.token_masks.TokenMasks``): ``rows`` index the
    batch's sampling rows; ``get`` waits for the bitmask (int32 [len(rows), ceil(V / 32)]) and returns it."""

    rows: list[int]
    waited: float

    def get(self) -> Any: ...


@dataclass(slots=True)
class BatchDescription:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV slot of every token
    decode_block_tables: list[list[int]] = field(default_factory=list)  # one per decode row (the first rows)
    decode_context_lens: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # the flat row whose logits each sampled token uses
    sampling: list[SamplingRow] = field(default_factory=list)  # aligned with sample_rows
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # KV block copies, run first
    released: list[int] = field(default_factory=list)  # handles whose sampling state the worker may drop
    lora_slots: list[int] | None = None  # LoRA: the adapter slot of each row, -1 for the base model; None: no adapter
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters to read into their slots before the step
    token_masks: TokenMaskSource | None = None  # structured output: the guided sampling rows' allowed tokens

    @property
    def num_decode(self) -> int:
        return len(self.decode_block_tables)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class WorkerOutput:
    token_ids: list[int]  # one per sampling row
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]]  # handle -> one per target token
    # beam-search rows: sampling row -> (token ids, log-probabilities) of its best continuations
    beams: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
