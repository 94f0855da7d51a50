"""The guided rows' token bitmask in a batch (structured output), filled by the engine core while the model runs."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch


class TokenMasks:
    """The tokens each guided sampling row may take: ``bits`` int32 [len(rows), ceil(V / 32)], bit t % 32 of word
    t // 32 set when token t is allowed; ``rows`` index the batch's sampling rows.

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
