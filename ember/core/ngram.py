"""Prompt lookup: a sequence's own tokens (prompt and output) as the draft source. Code edits, quoted passages and
repeated structure make the text about to be written a copy of text already there; the tokens that followed the
latest earlier occurrence of the sequence's last n tokens are a cheap guess at what comes next.

``NgramIndex`` keeps, for each n in [n_min, n_max], every n-gram of the sequence mapped to the start of its latest
occurrence that has a token after it; appending tokens updates it in O(new tokens x n) and a lookup is one dict
probe per n, longest first. A copy goes on where the last draft came from: while the tokens before that place still
equal the sequence's last ones, the draft continues from there, whatever occurrence is latest (code repeats short
n-grams everywhere, and the latest one is rarely the text being copied). A per-request list of extra tokens
(OpenAI's ``prediction``) is searched the same way, first."""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("n_min", "n_max", "tokens", "latest", "indexed", "follow", "follow_at")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence with a follower
        self.indexed = 0  # tokens whose n-grams ending before them are in ``latest``
        self.follow = -1  # where the last draft was taken from, and the context's length then (-1: none)
        self.follow_at = 0

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the sequence's new ones) and index the n-grams that now have a follower."""
        self.tokens.extend(tokens)
        seq, latest = self.tokens, self.latest
        for end in range(max(self.indexed, 1), len(seq)):  # n-grams ending at end - 1, followed by seq[end]
            for n in range(self.n_min, min(self.n_max, end) + 1):
                latest[tuple(seq[end - n:end])] = end - n
        self.indexed = len(seq)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens: those after the place the last draft came from, moved on by what context gained, while
        the n_max tokens before it equal context's last ones; else those that followed the longest of context's
        trailing n-grams found here (latest occurrence)."""
        if k <= 0:
            return []
        seq, at = self.tokens, len(context)
        if self.follow >= 0:
            q = self.follow + at - self.follow_at
            n = min(self.n_max, q, at)
            if n >= self.n_min and q < len(seq) and seq[q - n:q] == context[at - n:]:
                return self._take(q, k, at)
        for n in range(min(self.n_max, at), self.n_min - 1, -1):
            start = self.latest.get(tuple(context[at - n:]))
            if start is not None:
                return self._take(start + n, k, at)
        self.follow = -1
        return []

    def _take(self, q: int, k: int, at: int) -> list[int]:
        self.follow, self.follow_at = q, at
        return self.tokens[q:q + k]


SEPARATOR = -1  # between two outputs in ``RecentOutputs``: no n-gram across it matches, no draft runs past it


def newest_half(outputs: list[list[int]], max_tokens: int, max_outputs: int | None = None) -> tuple[list, int]:
    """The newest outputs within half of ``max_tokens`` (each counted with its separator) and of ``max_outputs``
    (at least one), oldest first, and their tokens: what a bounded store of recent outputs keeps when full."""
    most = max(1, max_outputs // 2) if max_outputs is not None else len(outputs)
    kept, total = [], 0
    for out in reversed(outputs):
        if total + len(out) + 1 > max_tokens // 2 or len(kept) >= most:
            break
        kept.append(out)
        total += len(out) + 1
    return kept[::-1], total


class RecentOutputs:
    """The outputs of recently finished requests, as one index (suffix decoding's observation: agents, templated
    answers and retried requests repeat earlier answers). A request whose own tokens give no draft looks here, for
    its last ``n`` tokens exactly (shorter n-grams match everywhere in many outputs). Bounded: past ``max_tokens``
    the older half of the outputs is dropped and the index rebuilt."""

    __slots__ = ("n", "max_tokens", "outputs", "total", "index")

    def __init__(self, n: int, max_tokens: int = 1 << 16) -> None:
        self.n, self.max_tokens = n, max_tokens
        self.outputs: list[list[int]] = []
        self.total = 0
        self.index = NgramIndex(n, n)

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= self.n:
            return
        tokens = tokens[-max(1, self.max_tokens // 2 - 1):]  # an output fits the half kept
        self.outputs.append(tokens)
        self.total += len(tokens) + 1
        if self.total <= self.max_tokens:
            self._index(tokens)
            return
        self.outputs, self.total = newest_half(self.outputs, self.max_tokens)
        self.index = NgramIndex(self.n, self.n)
        for out in self.outputs:
            self._index(out)

    def _index(self, out: list[int]) -> None:
        """Index an output; its last n-gram, followed by nothing, does not hide an occurrence that has a follower
        (earlier in it, or in an older output)."""
        latest, n = self.index.latest, self.n
        key = tuple(out[-n:])
        before = latest.get(key)
        start = len(self.index.tokens)
        self.index.extend([*out, SEPARATOR])
        inside = [i for i in range(len(out) - n) if tuple(out[i:i + n]) == key]
        if inside:
            latest[key] = start + inside[-1]
        elif before is not None:
            latest[key] = before
        else:
            latest.pop(key, None)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed context's last n tokens in the latest output holding them, to its end."""
        n = self.n
        if k <= 0 or len(context) < n:
            return []
        start = self.index.latest.get(tuple(context[-n:]))
        if start is None:
            return []
        draft = self.index.tokens[start + n:start + n + k]
        return draft[:draft.index(SEPARATOR)] if SEPARATOR in draft else draft
