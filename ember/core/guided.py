"""Structured output, the engine core's half: one llguidance matcher per guided sample, advanced with every token
the sample takes.

Each step the sampled rows' allowed-token masks are computed on a helper thread while the model runs (llguidance's
Rust code releases the GIL, so the two overlap) and travel to the worker inside the batch (``TokenMasks``); the
worker waits for them only when it samples. A matcher that failed (it never should: the sampled token is always
one its mask allowed) lets only EOS through, so its sample ends rather than run on unconstrained.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from ember.core.request import Sequence
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
        live: list[tuple[Any, int]] = []
        for j, (_, seq) in enumerate(rows):
            m = self._matcher(seq)
            if m.is_error():  # only EOS from here on
                for t in seq.request.params.eos_token_ids:
                    bit = 1 << (t % 32)
                    bits[j, t // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # as an int32
            else:
                live.append((m, j))
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ember-guides")
            self._llg_executor = llguidance.LLExecutor()

        def fill() -> None:
            t0 = time.perf_counter()
            llg.fill_next_token_bitmask_par(self._llg_executor, live, bits)
            self.mask_seconds += time.perf_counter() - t0

        self.masked_rows += len(rows)
        self.steps += 1
        return TokenMasks([i for i, _ in rows], bits, self._pool.submit(fill) if live else None)

    def advance(self, sampled: list[Sequence], tokens: list[int], masks: TokenMasks | None) -> None:
        """Feed each guided sample the token it took this step."""
        if masks is None:
            return
        masks.get()  # the helper is done with the matchers (the worker has normally waited already)
        self.wait_seconds += masks.waited
        for i in masks.rows:
            seq, m = sampled[i], self.matchers.get(sampled[i].seq_id)
            if m is None or m.is_error() or m.is_stopped():  # a finished grammar only takes EOS (ignore_eos)
                continue
            if not m.consume_token(tokens[i]):
                logger.warning("request %s: sample %d took token %d its grammar does not allow (%s); it ends at "
                               "the next EOS", seq.request.request_id, seq.index, tokens[i], m.get_error())

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
