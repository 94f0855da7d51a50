"""Structured output, the engine core's half: one llguidance matcher per guided sample, advanced with every token
the sample takes.

Each step the sampled rows' allowed-token masks are computed on a helper thread while the model runs (llguidance's
Rust code releases the GIL, so the two overlap) and travel to the worker inside the batch (``TokenMasks``); the
worker waits for them only when it samples. A matcher that failed (it never should: the sampled token is always
one its mask allowed) lets only EOS through, so its sample ends rather than run on unconstrained.

With speculative decoding a guided sample drafts only tokens its grammar takes (``valid_draft``); a row verifying
a draft of k tokens has k + 1 masks, the matcher's after each drafted token (llguidance advances it through the
draft and rolls it back), and after the step the matcher takes the kept tokens. A row after a drafted token taken
once the grammar had ended (llguidance leaves it empty) gets the row before it: the stopped matcher's own mask.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from ember.core.request import Sequence
from ember.core.speculator import kept_tokens
from ember.worker.token_masks import TokenMasks

logger = logging.getLogger("ember")


class GrammarSource(Protocol):
    """Where matchers come from (the front end's ``Grammars``: it holds the vocabulary the core never sees)."""

    vocab_size: int

    def matcher(self, grammar: str) -> Any:
        """A fresh llguidance ``LLMatcher`` at the start of a request's grammar text."""


class Guides:
    def __init__(self, source: GrammarSource | None) -> None:
        self.source = source
        self.matchers: dict[int, Any] = {}  # sample handle -> its matcher, until the sample is released
        self._pool: ThreadPoolExecutor | None = None  # the helper thread, and llguidance's own parallel executor,
        self._llg_executor: Any = None  # made on the first guided step
        self.mask_seconds = 0.0  # time spent computing masks (off the critical path where it overlaps)
        self.wait_seconds = 0.0  # time the steps waited for them (on the critical path)
        self.masked_rows = 0
        self.steps = 0

    def masks(self, sampled: list[Sequence]) -> TokenMasks | None:
        """Start computing this step's masks for the guided rows among sampled (aligned with the sampling rows)."""
        rows = [(i, seq) for i, seq in enumerate(sampled) if seq.request.record.grammar is not None]
        if not rows:
            return None
        import llguidance.torch as llg

        width = (self.source.vocab_size + 31) // 32
        bits = torch.zeros(len(rows), width, dtype=torch.int32)
        live: list[tuple[Any, int, list[int]]] = []
        drafted: list[int] = []  # rows after a drafted token
        j = 0
        while j < len(rows):  # a sequence verifying a draft of k tokens holds k + 1 consecutive rows
            seq = rows[j][1]
            m, draft = self._matcher(seq), seq.draft_token_ids
            if j + len(draft) >= len(rows) or rows[j + len(draft)][1] is not seq:  # llguidance writes k + 1 rows
                raise RuntimeError(f"guided rows {j}..{j + len(draft)} are not all sample {seq.seq_id}'s")
            if m.is_error():  # only EOS from here on
                for r in range(j, j + 1 + len(draft)):
                    _allow(bits, r, seq.request.params.eos_token_ids)
            else:
                live.append((m, j, list(draft)))
                drafted.extend(range(j + 1, j + 1 + len(draft)))
            j += 1 + len(draft)
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ember-guides")
            self._llg_executor = llguidance.LLExecutor()

        def fill() -> None:
            t0 = time.perf_counter()
            single = [(m, r) for m, r, draft in live if not draft]
            if single:
                llg.fill_next_token_bitmask_par(self._llg_executor, single, bits)
            if drafted:  # llguidance takes drafts of one token or more
                llg.fill_next_token_bitmask_par_with_draft_tokens(self._llg_executor, [x for x in live if x[2]], bits)
                for r in drafted:  # in order: a run of empty rows takes the stopped matcher's mask before it
                    if not bool(bits[r].any()):
                        bits[r] = bits[r - 1]
            self.mask_seconds += time.perf_counter() - t0

        self.masked_rows += len(rows)
        self.steps += 1
        return TokenMasks([i for i, _ in rows], bits, self._pool.submit(fill) if live else None)

    def advance(self, sampled: list[Sequence], tokens: list[int], masks: TokenMasks | None) -> None:
        """Feed each guided sample the tokens it took this step: the drafted tokens its sampler agreed with, then
        the sampler's own."""
        if masks is None:
            return
        masks.get()  # the helper is done with the matchers (the worker has normally waited already)
        self.wait_seconds += masks.waited
        rows, j = masks.rows, 0
        while j < len(rows):
            i = rows[j]
            seq, m = sampled[i], self.matchers.get(sampled[i].seq_id)
            draft = seq.draft_token_ids
            j += 1 + len(draft)
            kept = kept_tokens(draft, tokens[i:i + 1 + len(draft)])
            for t in draft[:kept] + [tokens[i + kept]]:
                if m is None or m.is_error() or m.is_stopped():  # a finished grammar only takes EOS (ignore_eos)
                    break
                if not m.consume_token(t):
                    logger.warning("request %s: sample %d took token %d its grammar does not allow (%s); it ends "
                                   "at the next EOS", seq.request.request_id, seq.index, t, m.get_error())

    def valid_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """The longest start of draft that seq's grammar takes from where seq is (``speculator.DraftCheck``). Ids
        past the tokenizer's vocabulary (a model's logits can be wider: Qwen2.5's 151,936 against 151,665 tokens; a
        prediction or a prompt of ids may hold them) end the draft before llguidance sees them: its check of such an
        id puts the matcher in its error state for good, which would end the request at the next token."""
        m = self._matcher(seq)
        vocab = self.source.vocab_size
        n = next((i for i, t in enumerate(draft) if not 0 <= t < vocab), len(draft))
        if m.is_error() or n == 0:
            return []
        return draft[:m.validate_tokens(draft[:n])]

    def release(self, handles: list[int]) -> None:
        for h in handles:
            self.matchers.pop(h, None)

    def _matcher(self, seq: Sequence) -> Any:
        m = self.matchers.get(seq.seq_id)
        if m is None:
            m = self.matchers[seq.seq_id] = self.source.matcher(seq.request.record.grammar)
        return m

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _allow(bits: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    """Set the bits of token_ids in row of an int32 bitmask (32 tokens a word)."""
    for t in token_ids:
        bit = 1 << (t % 32)
        bits[row, t // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # as an int32
