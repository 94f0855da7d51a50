"""Speculative decoding's draft model (``speculative_config={"method": "draft_model", "model": ...}``): a smaller
model with the target's tokenizer drafts each drafting row's tokens inside the step, just before the target
verifies them. The core sends such a draft as placeholders (it decides how many tokens, the scheduler gives them
slots); the runner fills them from ``Drafter.propose`` and returns what it drafted (``WorkerOutput.drafts``).

The draft's KV cache is a second pool with the target's block numbers: a sequence's draft KV lives in the blocks
that hold its target KV, so the pool is sized with the target's (``startup.start``), freed with the sequence's
blocks, and needs no block table of its own. A draft decides only speed, never output (the target samples every
position), so a stale entry (a block shared through the prefix cache or copied on write) costs acceptance, not
correctness.

Per sequence the drafter knows how many leading positions of its draft KV hold the sequence's tokens. A draft
feeds the positions after those (the tokens added since its last draft, often just the last), in passes of at most
``max_tokens`` (the step's budget), the last pass giving the first drafted token; then it decodes greedily, one
batched decode step per further drafted token. A new sequence's draft KV holds nothing (it is not shared through
the prefix cache): the core orders its prompt fed a share a step (``catch_up``; ``DraftCosts.catch_up_tokens`` a
step, about one target decode step's worth, ``WorkerInfo.draft_catch_up``) before it sends the sequence's first
draft.

The models' rows may differ where the tokenizer is one (Qwen2.5's 0.5B pads its 151,665 tokens to 151,936 rows,
its 7B to 152,064): a draft proposes only ids below ``limit``, those both models embed (``shared_vocabulary``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ember.layers.attention import AttentionMetadata, PrefillSpan, bind_attention_backend
from ember.layers.sampler import greedy_tokens
from ember.model_loader import LoadedModel
from ember.worker.input_batch import HeldSequence, InputBatch
from ember.worker.startup import kv_bytes_per_block, kv_format


@dataclass(slots=True)
class _Cached:
    """What one sequence's draft KV holds: its first ``valid`` tokens, then the drafted tokens ``fed`` from
    position ``valid`` on (right as far as the sequence kept them)."""

    valid: int
    fed: list[int]


@dataclass(slots=True)
class _Row:
    """A sequence's tokens a draft pass feeds, from position ``start`` on (one token: a decode row)."""

    seq: HeldSequence
    tokens: list[int]
    start: int


class Drafter:
    def __init__(self, loaded: LoadedModel, device: torch.device, block_size: int, kv_cache_dtype: str,
                 batch_invariant: bool, limit: int, max_tokens: int = 2048) -> None:
        self.loaded, self.model, self.device, self.block_size = loaded, loaded.model, device, block_size
        self.kv_cache_dtype, self.limit = kv_cache_dtype, limit
        self.rows = loaded.shape.vocab_size  # the ids its embedding holds
        self.max_tokens = max_tokens  # tokens a pass holds: the step's budget
        self.layers = self.model.attention_layers()
        self.kv_format = fmt = kv_format(loaded, kv_cache_dtype)
        for layer in self.layers:
            layer.kv_format = fmt
        bind_attention_backend(self.layers, device, fmt, block_size, batch_invariant=batch_invariant)
        self.pool = torch.empty(0)
        self.cached: dict[int, _Cached] = {}  # handle -> what its draft KV holds

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.loaded, self.block_size, self.kv_cache_dtype)

    def bind(self, num_blocks: int | None) -> None:
        """A pool of ``num_blocks`` (the target pool's count, the same block numbers) bound to the draft's layers;
        None frees it."""
        self.cached.clear()
        if num_blocks is None:
            self.pool = torch.empty(0)
            for layer in self.layers:
                layer.k_cache = layer.v_cache = torch.empty(0)
            return
        first = self.layers[0]
        self.pool = torch.zeros(2, len(self.layers), num_blocks, self.block_size, first.num_kv_heads,
                                self.kv_format.entry, dtype=self.kv_format.pool_dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = self.pool[0, i], self.pool[1, i]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The target pool's copies within the pool (copy on write), mirrored."""
        if self.pool.numel():
            self.pool.index_copy_(2, dst.to(self.device), self.pool.index_select(2, src.to(self.device)))

    def forget(self, handles: list[int]) -> None:
        for h in handles:
            self.cached.pop(h, None)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, tables: torch.Tensor, wants: dict[int, int]) -> dict[int, list[int]]:
        """handle -> k greedy draft tokens after its sequence's tokens, for every (handle, k) in ``wants``. The
        scheduler gave each such sequence blocks for k more tokens than it holds, where the draft's KV goes."""
        held = {h: batch.seqs[h] for h in wants}
        drafts = {h: [t] for h, t in self._first(held, tables).items()}
        for step in range(1, max(wants.values())):
            live = [h for h in wants if wants[h] > step]
            rows = [_Row(held[h], [drafts[h][-1]], len(held[h].token_ids) - 1 + step) for h in live]
            for h, t in zip(live, self._greedy(rows, tables)):
                drafts[h].append(t)
        for h in wants:
            self.cached[h] = _Cached(len(held[h].token_ids), drafts[h][:-1])
        return drafts

    @torch.inference_mode()
    def catch_up(self, batch: InputBatch, tables: torch.Tensor, orders: dict[int, int]) -> None:
        """Feed each (handle, m) of ``orders`` the next m tokens its draft KV lacks (never its last: the draft that
        follows feeds that), in one pass: the core spreads a new sequence's prompt over steps in which it drafts
        nothing (``Speculator``), so that no step stalls for a long prompt's catch-up."""
        rows = []
        for h, m in orders.items():
            seq = batch.seqs[h]
            a = self._lacking(h, seq)
            end = min(a + m, len(seq.token_ids) - 1)
            if end > a:
                rows.append(_Row(seq, seq.token_ids[a:end], a))
                self.cached[h] = _Cached(end, [])
        if rows:
            self._pass(rows, tables)

    def _lacking(self, h: int, seq: HeldSequence) -> int:
        """The first position of ``seq`` its draft KV lacks (at most its last token's)."""
        n = len(seq.token_ids)
        c = self.cached.get(h)
        if c is None:
            return 0
        valid = min(c.valid, n - 1)
        for t in c.fed:  # the drafted tokens the sequence kept are its tokens there
            if valid >= n - 1 or seq.token_ids[valid] != t:
                break
            valid += 1
        return valid

    def _first(self, held: dict[int, HeldSequence], tables: torch.Tensor) -> dict[int, int]:
        """Feed every sequence's tokens from the first its draft KV lacks through its last; handle -> the greedy
        token after them. A pass holds at most ``max_tokens`` tokens: while more are left, passes feed the
        earliest (never a span's last token, as chunked prefill cuts a prompt); the last pass feeds the rest and
        gives the first drafted tokens, so a step whose drafts were all kept costs no pass more than one whose
        draft was cut."""
        spans = {h: [self._lacking(h, seq), len(seq.token_ids)] for h, seq in held.items()}
        while sum(b - a for a, b in spans.values()) > self.max_tokens:
            rows, room = [], self.max_tokens
            for h, span in spans.items():
                a, b = span
                end = min(b - 1, a + room)
                if end > a:
                    rows.append(_Row(held[h], held[h].token_ids[a:end], a))
                    room -= end - a
                    span[0] = end
            if not rows:  # every span is down to its last token: more rows than a pass holds, fed in one
                break
            self._pass(rows, tables)
        rows = [_Row(held[h], held[h].token_ids[a:b], a) for h, (a, b) in spans.items()]
        return dict(zip(spans, self._greedy(rows, tables)))

    def _greedy(self, rows: list[_Row], tables: torch.Tensor) -> list[int]:
        """One pass over ``rows``; the greedy token after each row's last, in the rows' order."""
        hidden, order, last = self._pass(rows, tables)
        tokens = greedy_tokens(self.model.compute_logits(hidden[self._tensor(last)])[:, :self.limit]).tolist()
        out = [0] * len(rows)
        for i, t in zip(order, tokens):
            out[i] = t
        return out

    def _pass(self, rows: list[_Row], tables: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """One forward pass of the draft model, writing its KV: one-token rows as decode rows (first, as the
        kernels want), longer ones as prefill spans over the paged KV (as chunked prefill). The hidden states,
        the rows' order in the pass and each one's last index there."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens) > 1)
        decodes = [rows[i] for i in order if len(rows[i].tokens) == 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills, last = [], []
        for i in order:
            row = rows[i]
            end = row.start + len(row.tokens)
            if len(row.tokens) > 1:
                prefills.append(PrefillSpan(len(ids), len(row.tokens), end, self._table(row.seq, tables)))
            ids.extend(row.tokens)
            positions.extend(range(row.start, end))
            slots.extend(self._slot(row.seq, p) for p in range(row.start, end))
            last.append(len(ids) - 1)
        decode_tables = context_lens = None
        if decodes:
            width = max(len(r.seq.block_ids) for r in decodes)
            which = torch.tensor([r.seq.row for r in decodes], dtype=torch.long)
            decode_tables = tables[which, :width].to(self.device)
            context_lens = self._tensor([r.start + 1 for r in decodes])
        meta = AttentionMetadata(self._tensor(slots), len(decodes), decode_tables, context_lens, prefills)
        tokens = self._tensor(ids)
        if max(ids) >= self.rows:  # an id of the model's past the draft's rows (a prompt's, a padding id sampled):
            tokens = torch.where(tokens < self.rows, tokens, 0)  # another token there costs acceptance, not output
        return self.model(tokens, self._tensor(positions), meta), order, last

    def _slot(self, seq: HeldSequence, position: int) -> int:
        bs = self.block_size
        return seq.block_ids[position // bs] * bs + position % bs

    def _table(self, seq: HeldSequence, tables: torch.Tensor) -> torch.Tensor:
        return tables[seq.row, :len(seq.block_ids)].to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


@dataclass(frozen=True, slots=True)
class DraftCosts:
    """What the draft model costs on this machine against a target decode step: a drafted token (one batched decode
    step of the draft), and how many prompt tokens its catch-up feeds for the price of one target step."""

    token: float
    catch_up_tokens: int


@torch.inference_mode()
def measure_draft_costs(target: torch.nn.Module, draft: torch.nn.Module, device: torch.device, block_size: int,
                        context: int = 64, max_tokens: int = 2048, repeats: int = 7) -> DraftCosts:
    """Measured at start-up, steps run in turn, medians: a draft token is the ratio of the two models' batch-1
    decode steps (forward and logits) at ``context`` tokens (a small model's step costs more than its bytes say:
    per-layer overheads and the full vocabulary's logits); the catch-up's tokens a step are those a draft prefill
    of ``context`` tokens feeds in one target step's time (at least 16, at most ``max_tokens``). Writes blocks 0 ..
    context / block_size of both pools: the caller clears them."""
    width = -(-context // block_size)
    table = torch.arange(width, device=device)[None, :]
    pos = torch.tensor([context - 1], dtype=torch.long, device=device)
    meta = AttentionMetadata(table[:, -1] * block_size + (context - 1) % block_size, 1, table, pos + 1, [])
    token = torch.zeros(1, dtype=torch.long, device=device)
    prompt = torch.zeros(context, dtype=torch.long, device=device)
    positions = torch.arange(context, device=device)
    slots = table[0].repeat_interleave(block_size)[:context] * block_size + positions % block_size
    prefill = AttentionMetadata(slots, 0, None, None, [PrefillSpan(0, context, context, table[0])])

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def step(model: torch.nn.Module) -> float:
        return timed(lambda: model.compute_logits(model(token, pos, meta)))

    def catch_up() -> float:
        return timed(lambda: draft.compute_logits(draft(prompt, positions, prefill)[-1:]))

    step(target), step(draft), catch_up()  # warm-up
    ratios, tokens = [], []
    for _ in range(repeats):
        t = step(target)
        ratios.append(step(draft) / t)
        tokens.append(context * t / catch_up())
    return DraftCosts(statistics.median(ratios), min(max_tokens, max(16, int(statistics.median(tokens)))))
