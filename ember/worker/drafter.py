"""Speculative decoding's draft model (``speculative_config={"method": "draft_model", "model": ...}``): a smaller
model with the target's tokenizer drafts each drafting row's tokens inside the step, just before the target
verifies them. The core sends such a draft as placeholders (it decides how many tokens, the scheduler gives them
slots); the runner fills them from ``Drafter.propose`` and returns what it drafted (``WorkerOutput.drafts``).

The draft's KV cache is a second pool with the target's block numbers: a sequence's draft KV lives in the blocks
that hold its target KV, so the pool is sized with the target's (``startup.start``), freed with the sequence's
blocks, and needs no block table of its own. A draft decides only speed, never output (the target samples every
position), so a stale entry (a block shared through the prefix cache or copied on write) costs acceptance, not
correctness.

Per sequence the drafter knows how many leading positions of its draft KV hold the sequence's tokens. Before a draft
it feeds the positions after those but the last (the whole prompt the first time, the draft's KV not being shared
through the prefix cache; afterwards the tokens added since its last draft), in passes of at most ``max_tokens``
(the step's budget); then it decodes greedily: the last token at its position, then each drafted token, one batched
decode step per drafted token.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ember.layers.attention import AttentionMetadata, PrefillSpan, bind_attention_backend
from ember.model_loader import LoadedModel
from ember.worker.input_batch import HeldSequence, InputBatch
from ember.worker.startup import kv_bytes_per_block, kv_format


@dataclass(slots=True)
class _Cached:
    """What one sequence's draft KV holds: its first ``valid`` tokens, then the drafted tokens ``fed`` from
    position ``valid`` on (right as far as the sequence kept them)."""

    valid: int
    fed: list[int]


class Drafter:
    def __init__(self, loaded: LoadedModel, device: torch.device, block_size: int, kv_cache_dtype: str,
                 batch_invariant: bool, max_tokens: int = 2048) -> None:
        self.loaded, self.model, self.device, self.block_size = loaded, loaded.model, device, block_size
        self.kv_cache_dtype, self.max_tokens = kv_cache_dtype, max_tokens
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
        self._catch_up(held, tables)
        handles = list(wants)
        drafts: dict[int, list[int]] = {h: [] for h in handles}
        for step in range(max(wants.values())):
            live = [h for h in handles if wants[h] > step]
            tokens = [held[h].token_ids[-1] if step == 0 else drafts[h][-1] for h in live]
            positions = [len(held[h].token_ids) - 1 + step for h in live]
            logits = self._decode(live, held, tokens, positions, tables)
            for h, t in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[h].append(t)
        for h in handles:
            n = len(held[h].token_ids)
            self.cached[h] = _Cached(n, drafts[h][:-1])
        return drafts

    def _catch_up(self, held: dict[int, HeldSequence], tables: torch.Tensor) -> None:
        """Feed every sequence's tokens from the first its draft KV lacks up to (not including) its last, in
        forward passes of at most ``max_tokens`` tokens (a long span is cut, as chunked prefill cuts a prompt)."""
        spans = []  # (handle, first position, end)
        for h, seq in held.items():
            n = len(seq.token_ids)
            c = self.cached.get(h)
            valid = 0
            if c is not None:
                valid = min(c.valid, n - 1)
                for t in c.fed:  # the drafted tokens the sequence kept are its tokens there
                    if valid >= n - 1 or seq.token_ids[valid] != t:
                        break
                    valid += 1
            if valid < n - 1:
                spans.append((h, valid, n - 1))
        while spans:
            ids: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            prefills, rest = [], []
            for h, a, b in spans:
                room = self.max_tokens - len(ids)
                if room <= 0:
                    rest.append((h, a, b))
                    continue
                end = min(b, a + room)
                seq = held[h]
                prefills.append(PrefillSpan(len(ids), end - a, end, self._table(seq, tables)))
                ids.extend(seq.token_ids[a:end])
                positions.extend(range(a, end))
                slots.extend(self._slot(seq, p) for p in range(a, end))
                if end < b:
                    rest.append((h, end, b))
            meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=self.device), 0, None, None,
                                     prefills)
            self.model(self._tensor(ids), self._tensor(positions), meta)
            spans = rest

    def _decode(self, live: list[int], held: dict[int, HeldSequence], tokens: list[int], positions: list[int],
                tables: torch.Tensor) -> torch.Tensor:
        """One batched decode step of the draft model: each row's token at its position; the logits."""
        seqs = [held[h] for h in live]
        width = max(len(s.block_ids) for s in seqs)
        which = torch.tensor([s.row for s in seqs], dtype=torch.long)
        slots = [self._slot(s, p) for s, p in zip(seqs, positions)]
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=self.device), len(live),
                                 tables[which, :width].to(self.device),
                                 torch.tensor([p + 1 for p in positions], dtype=torch.long, device=self.device), [])
        hidden = self.model(self._tensor(tokens), self._tensor(positions), meta)
        return self.model.compute_logits(hidden)

    def _slot(self, seq: HeldSequence, position: int) -> int:
        bs = self.block_size
        return seq.block_ids[position // bs] * bs + position % bs

    def _table(self, seq: HeldSequence, tables: torch.Tensor) -> torch.Tensor:
        return tables[seq.row, :len(seq.block_ids)].to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


@torch.inference_mode()
def measure_draft_cost(target: torch.nn.Module, draft: torch.nn.Module, device: torch.device, block_size: int,
                       context: int = 64, repeats: int = 7) -> float:
    """A draft token's cost against a target decode step: the median ratio of their batch-1 decode steps (forward
    and logits) at ``context`` tokens, run in turn, measured on this machine at start-up (a small model's step costs
    more than its bytes say: per-layer overheads and the full vocabulary's logits). Writes blocks 0 ..
    context / block_size of both pools: the caller clears them."""
    width = -(-context // block_size)
    table = torch.arange(width, device=device)[None, :]
    pos = torch.tensor([context - 1], dtype=torch.long, device=device)
    meta = AttentionMetadata(table[:, -1] * block_size + (context - 1) % block_size, 1, table, pos + 1, [])
    token = torch.zeros(1, dtype=torch.long, device=device)

    def step(model: torch.nn.Module) -> float:
        start = time.perf_counter()
        model.compute_logits(model(token, pos, meta))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    step(target), step(draft)  # warm-up
    return statistics.median(step(draft) / step(target) for _ in range(repeats))
