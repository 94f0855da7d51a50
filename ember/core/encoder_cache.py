"""The vision encoder as scheduled work: which images a step encodes, within a budget of encoder tokens a step,
and which encodings the workers keep (vLLM's encoder cache manager, smaller).

The workers keep each image's embeddings by content hash until the core says to drop them; this class mirrors
what they hold, so the scheduler knows what a prefill chunk still needs encoded. A chunk that would need more
encoding than the step has left is cut before the first image that does not fit (or waits a step when it starts
inside one). Encodings a step uses are pinned for that step; the least recently used others are dropped when
the cache would pass its capacity. A dropped encoding that a partly prefilled prompt still needs is encoded again
when its chunk comes: correct, only slower."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ember.protocol import MultiModalInput


class EncoderCache:
    def __init__(self, budget: int, capacity: int) -> None:
        """budget: encoder tokens a step may compute; capacity: encoder tokens the workers keep (>= budget)."""
        self.budget, self.capacity = budget, max(capacity, budget)
        self.cached: OrderedDict[str, int] = OrderedDict()  # hash -> tokens, least recently used first
        self.left = budget
        self.step_hashes: set[str] = set()  # used by this step's chunks: never dropped in it
        self.encode: list[MultiModalInput] = []
        self.free: list[str] = []
        self.encoded = 0  # images encoded since start (a repeated image counts once while it stays cached)

    def begin_step(self) -> None:
        self.left, self.step_hashes, self.encode, self.free = self.budget, set(), [], []

    def fit(self, items: Sequence[MultiModalInput], start: int, n: int) -> int:
        """How many of the n tokens from ``start`` a chunk may compute given what is left of this step's budget."""
        left, pending = self.left, set()
        for item in items:
            p = item.placeholder
            if not p.overlaps(start, start + n):
                continue
            if item.hash in self.cached or item.hash in self.step_hashes or item.hash in pending:
                continue
            if p.length > left and left < self.budget:  # an image larger than a whole step's budget runs alone
                return max(0, p.offset - start)
            left -= p.length
            pending.add(item.hash)
        return n

    def schedule(self, items: Sequence[MultiModalInput], start: int, n: int) -> None:
        """A chunk [start, start + n) was scheduled: encode what it needs that the workers do not hold."""
        for item in items:
            if not item.placeholder.overlaps(start, start + n):
                continue
            h = item.hash
            self.step_hashes.add(h)
            if h in self.cached:
                self.cached.move_to_end(h)
                continue
            self._make_room(item.placeholder.length)
            self.cached[h] = item.placeholder.length
            self.left -= item.placeholder.length
            self.encode.append(item)
            self.encoded += 1

    def _make_room(self, tokens: int) -> None:
        held = sum(self.cached.values())
        for h in list(self.cached):
            if held + tokens <= self.capacity:
                return
            if h in self.step_hashes:
                continue
            held -= self.cached.pop(h)
            self.free.append(h)
