"""The sequences a model runner holds between steps, and one step's rows planned from them: the receiving half of
``SchedulerOutput``'s diffs. Plain Python, no torch, so the scripted executor (``ember.executor.scripted``) plans
the same rows a real runner does."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.protocol import (KVWindow, NewSequence, Placeholder, PoolingParams, PromptLogprobsRows, SamplingRow,
                            SchedulerOutput)
from ember.sampling_params import SamplingParams
from ember.worker.mrope import mrope_positions


@dataclass(slots=True)
class HeldSequence:
    """What a runner keeps of one sequence: its tokens, its blocks, how far its KV goes, how it samples."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int | None
    lora_slot: int
    prompt_logprobs: int | None
    row: int  # its row of the runner's block-table tensor
    reads_history: bool  # its sampling row carries the token history (penalties, bans)
    pooling: PoolingParams | None = None  # a pooling request: its rows are pooled, never sampled
    placeholders: tuple[Placeholder, ...] = ()  # its prompt's image positions


@dataclass(frozen=True, slots=True)
class EmbedSpan:
    """Flat rows row..row+count-1 take rows first..first+count-1 of the encoding hashed ``hash`` in place of
    their token embeddings (an image's placeholder positions in this step's chunk)."""

    row: int
    hash: str
    first: int
    count: int


@dataclass(slots=True)
class PrefillRows:
    start: int  # first row of this chunk in the flat batch
    length: int  # query tokens this step
    context_len: int  # tokens in the cache after this step, these included
    table_row: int  # its row of the block-table tensor
    num_blocks: int  # blocks its table has
    draft: bool = False  # a decoding row verifying a draft (its last token, then the draft)


@dataclass(frozen=True, slots=True)
class PoolingRows:
    """A pooling sequence's chunk in this step: flat rows start..start+length-1 hold its prompt positions
    position..position+length-1; ``last``: the chunk ends the prompt, so the pooled vector is due."""

    handle: int
    start: int
    length: int
    position: int
    last: bool
    params: PoolingParams


@dataclass(slots=True)
class StepRows:
    """One step's flat ragged batch, decode rows first: what the runner turns into tensors."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV slot of every token
    decode_table_rows: list[int] = field(default_factory=list)  # the block-table row of each decode row
    decode_context_lens: list[int] = field(default_factory=list)
    decode_width: int = 0  # the most blocks a decode row's table has
    prefills: list[PrefillRows] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # the flat row whose logits each sampled token uses
    sampling: list[SamplingRow] = field(default_factory=list)  # aligned with sample_rows
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)
    pooling: list[PoolingRows] = field(default_factory=list)
    lora_slots: list[int] | None = None  # LoRA: each row's adapter slot (-1: base); None: no row has an adapter
    embeds: list[EmbedSpan] = field(default_factory=list)  # rows that take an image's encoding
    # M-RoPE models (InputBatch(mrope=True)): each row's (temporal, height, width) positions; None for the others
    mrope_positions: tuple[list[int], list[int], list[int]] | None = None

    @property
    def num_decode(self) -> int:
        return len(self.decode_table_rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class InputBatch:
    """Applies each ``SchedulerOutput`` to the held sequences and plans its rows. ``table_writes`` lists the
    block-table changes (row, first column, block ids) since the last call, for a runner keeping them in a tensor."""

    def __init__(self, block_size: int, window: KVWindow | None = None, mrope: bool = False) -> None:
        """mrope: plan the 3-D positions of a multimodal-RoPE model too (``StepRows.mrope_positions``)."""
        self.block_size = block_size
        self.window = window
        self.mrope = mrope
        self.seqs: dict[int, HeldSequence] = {}
        self._free_rows: list[int] = []
        self.num_rows = 0  # rows handed out so far (the table tensor must have as many)
        self.table_writes: list[tuple[int, int, list[int]]] = []

    def _drop(self, handle: int) -> None:
        held = self.seqs.pop(handle, None)
        if held is not None:
            self._free_rows.append(held.row)

    def _add(self, new: NewSequence) -> None:
        self._drop(new.handle)  # a resumed sequence replaces what was held of it
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row, self.num_rows = self.num_rows, self.num_rows + 1
        p = new.params
        self.seqs[new.handle] = HeldSequence(list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                             list(new.block_ids), p, new.seed, new.lora_slot, new.prompt_logprobs,
                                             row, SamplingRow.reads_history(p), new.pooling, new.placeholders)
        self.table_writes.append((row, 0, new.block_ids))

    def update(self, out: SchedulerOutput) -> None:
        """Finished and preempted sequences go, new ones come, the others grow by their diffs."""
        for handle in out.finished:
            self._drop(handle)
        for handle in out.preempted:
            self._drop(handle)
        for new in out.new:
            self._add(new)
        seqs = self.seqs
        for handle, tokens in out.new_token_ids.items():
            seqs[handle].token_ids.extend(tokens)
        for handle, blocks in out.new_block_ids.items():
            held = seqs[handle]
            self.table_writes.append((held.row, len(held.block_ids), blocks))
            held.block_ids.extend(blocks)
        for handle, computed in out.num_computed_tokens.items():  # after a verified draft: what the core kept
            seqs[handle].num_computed_tokens = computed

    def take_table_writes(self) -> list[tuple[int, int, list[int]]]:
        writes, self.table_writes = self.table_writes, []
        return writes

    def plan(self, out: SchedulerOutput, drafts: dict[int, list[int]] | None = None) -> StepRows:
        """The step's rows from the held sequences (after ``update``); then every sequence's computed tokens
        advance by what it runs, as the core counts them. drafts: the message's, placeholders filled (a draft
        model's)."""
        rows = StepRows()
        ids, positions, slots, bs, window = rows.input_ids, rows.positions, rows.slots, self.block_size, self.window
        seqs = self.seqs
        adapted = any(seqs[h].lora_slot >= 0 for h in out.handles)
        if adapted:
            rows.lora_slots = []
        drafts = out.draft_token_ids if drafts is None else drafts
        if self.mrope:
            rows.mrope_positions = ([], [], [])
        for handle, n in zip(out.handles, out.num_tokens):
            held = seqs[handle]
            start, c, table = len(ids), held.num_computed_tokens, held.block_ids
            tokens = held.token_ids
            draft = drafts.get(handle) if drafts else None
            if draft is not None:
                self._plan_draft(rows, held, handle, draft)
                continue
            if n == 1:
                ids.append(tokens[c])
                positions.append(c)
                p = c if window is None else window.slot(c)
                slots.append(table[p // bs] * bs + p % bs)
                rows.decode_table_rows.append(held.row)
                rows.decode_context_lens.append(c + 1 if window is None else window.kept(c + 1))
                rows.decode_width = max(rows.decode_width, len(table))
            else:
                ids.extend(tokens[c:c + n])
                positions.extend(range(c, c + n))
                where = range(c, c + n) if window is None else [window.slot(p) for p in range(c, c + n)]
                slots.extend(table[p // bs] * bs + p % bs for p in where)
                rows.prefills.append(PrefillRows(start, n, c + n, held.row, len(table)))
            if adapted:
                rows.lora_slots.extend([held.lora_slot] * n)
            if rows.mrope_positions is not None:
                _extend_mrope(rows, held, c, n)
            for ph in held.placeholders:
                if ph.overlaps(c, c + n):
                    lo, hi = max(c, ph.offset), min(c + n, ph.end)
                    rows.embeds.append(EmbedSpan(start + lo - c, ph.hash, lo - ph.offset, hi - lo))
            if held.pooling is not None:
                rows.pooling.append(PoolingRows(handle, start, n, c, c + n == len(tokens), held.pooling))
            elif c + n == len(tokens):
                rows.sample_rows.append(start + n - 1)
                rows.sampling.append(SamplingRow(handle, held.params, held.seed, len(tokens) - held.num_prompt_tokens,
                                                 tokens if held.reads_history else None, held.num_prompt_tokens))
            if held.prompt_logprobs is not None and c < held.num_prompt_tokens:
                # rows at positions c..end-1 predict prompt tokens c+1..end
                end = min(c + n, held.num_prompt_tokens - 1)
                rows.prompt_logprobs.append(PromptLogprobsRows(handle, start, tokens[c + 1:end + 1],
                                                               held.prompt_logprobs))
            held.num_computed_tokens = c + n
        return rows

    def _plan_draft(self, rows: StepRows, held: HeldSequence, handle: int, draft: list[int]) -> None:
        """A decoding row verifying a draft: its last token and the draft as one short prefill span, every position
        sampled (row j as the sample's output token j would be, its history holding the j drafted tokens before
        it). Only the last token counts as computed: the core sends the count once it knows which drafted tokens
        were kept."""
        bs, c, table, tokens = self.block_size, held.num_computed_tokens, held.block_ids, held.token_ids
        n, start = 1 + len(draft), len(rows.input_ids)
        rows.input_ids.append(tokens[c])
        rows.input_ids.extend(draft)
        rows.positions.extend(range(c, c + n))
        rows.slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
        rows.prefills.append(PrefillRows(start, n, c + n, held.row, len(table), draft=True))
        if rows.lora_slots is not None:
            rows.lora_slots.extend([held.lora_slot] * n)
        if rows.mrope_positions is not None:
            _extend_mrope(rows, held, c, n)
        done = len(tokens) - held.num_prompt_tokens
        for j in range(n):
            rows.sample_rows.append(start + j)
            # position j's history: the sequence's tokens and the j drafted before it (penalties, bans read it)
            history = (tokens + draft[:j] if j else tokens) if held.reads_history else None
            rows.sampling.append(SamplingRow(handle, held.params, held.seed, done + j, history,
                                             held.num_prompt_tokens, j))
        held.num_computed_tokens = c + 1


def _extend_mrope(rows: StepRows, held: HeldSequence, start: int, count: int) -> None:
    for out, part in zip(rows.mrope_positions, mrope_positions(held.placeholders, start, count)):
        out.extend(part)
