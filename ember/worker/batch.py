"""What the engine core sends a worker each step, and what comes back: plain lists and numbers (and the guided rows'
token bitmask), picklable.

This is exactly what a tensor-parallel broadcast or a pipeline stage carries; the worker builds every tensor
from it. Rows are ordered decodes first, then prefill chunks.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

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


class TokenMasks:
    """The tokens each guided sampling row may take (structured output): ``bits`` int32 [len(rows), ceil(V / 32)],
    bit t % 32 of word t // 32 set when token t is allowed; ``rows`` index the batch's sampling rows.

    The engine core fills the bits on a helper thread while the model runs; ``get`` waits for them (``waited``
    counts the seconds the step spent blocked). Pickled for another rank, it is sent filled."""

    __slots__ = ("rows", "bits", "_ready", "waited")

    def __init__(self, rows: list[int], bits: torch.Tensor, ready: Future | None = None) -> None:
        self.rows, self.bits, self._ready, self.waited = rows, bits, ready, 0.0

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            t0 = time.perf_counter()
            self._ready.result()
            self._ready, self.waited = None, time.perf_counter() - t0
        return self.bits

    def __reduce__(self):
        return TokenMasks, (self.rows, self.get())


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """Read the PEFT adapter at ``path`` into slot ``slot`` of every projection (replacing what was there)."""

    slot: int
    path: str


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
    lora_slots: list[int] | None = None  # LoRA: the adapter slot of each row, -1 for the base model; None: no adapter
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters to read into their slots before the step
    token_masks: TokenMasks | None = None  # structured output: the guided sampling rows' allowed tokens

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
