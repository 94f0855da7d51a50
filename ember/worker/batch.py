"""What the engine core sends a worker each step, and what comes back: plain lists and numbers, picklable.

This is exactly what a tensor-parallel broadcast or a pipeline stage carries; the worker builds every tensor
from it. Rows are ordered decodes first, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.layers.logits_processors import SamplingRow
from ember.layers.sampler import TokenLogprobs

# kinds of block copy: device -> host and host -> device (the host tier), device -> device (a beam's partial block,
# copied on write)
SWAP_OUT, SWAP_IN, COPY = "out", "in", "copy"


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
    copies: list[tuple[str, int, int]] = field(default_factory=list)  # host-tier block copies, run first
    released: list[int] = field(default_factory=list)  # handles whose sampling state the worker may drop
    adapter_ids: list[int] | None = None  # one per row once adapters exist; None: the base model

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
