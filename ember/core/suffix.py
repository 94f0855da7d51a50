"""Suffix decoding (Oliaro et al., arXiv 2411.04975; vLLM's ``method="suffix"``): drafts from the earlier
occurrences of the sequence's latest tokens, weighted by how often each continuation followed them, in the sequence
itself and in the outputs of recently finished requests.

Prompt lookup (``ngram.NgramIndex``) takes the tokens after one occurrence of a fixed-length n-gram. Here the
match is as long as it goes (up to ``max_depth`` tokens), the draft follows the continuation most occurrences of the
match share, and each drafted token carries the share of occurrences that agree on the path so far: the draft
stops where that falls below ``min_token_prob`` (where the text branched before, the model is likely to branch
too). A match of L tokens drafts at most ``max_spec_factor * L`` tokens (a short match is weak evidence); of the
match lengths the draft with the most expected kept tokens (the sum of its tokens' shares) wins.

The paper's structure is a suffix tree with a count per node; the same walk is done here from a list of the
positions that followed each ``KEY``-token gram: appending a token is one list append, and a lookup narrows the
latest ``MAX_OCCURRENCES`` positions of the last gram one matched token at a time. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ember.core.ngram import SEPARATOR, newest_half  # SEPARATOR: between two documents of one index

KEY = 2  # the shortest match that drafts (one token matches everywhere)
MAX_OCCURRENCES = 32  # latest occurrences of the last gram a lookup weighs: bounds its cost on repetitive text
RESYNC_WINDOW = 16  # how far past where a copy stood a resync looks for the sequence's last token
RESYNC_MIN_MATCH = 8  # a resync follows a draft from a match this long (a copy), not any short match


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    tokens: list[int]
    score: float  # expected kept tokens: the sum of each drafted token's share of the occurrences
    start: int = -1  # where in the index's tokens the draft was read (the latest occurrence on its path)
    match: int = 0  # the matched tokens it follows (0: a resync's)


NO_DRAFT = SuffixDraft([], 0.0)


class SuffixIndex:
    """A token sequence (one request's prompt and output, or many outputs with ``SEPARATOR`` between them) and, for
    each ``KEY``-gram, the positions of the tokens that followed it, oldest first.

    resync (an index of the sequence that drafts from it): where no match drafts, a copy that skipped or changed a
    token goes on. A model copying a text drops a word or changes a line break, its next tokens are the text's again,
    but the last two tokens are found nowhere; the sequence's last token found just past where the last draft was
    read drafts what follows it there (an edit deletes, and the copy resumes a step sooner; a changed token is
    found nowhere, and the next step, the copy's next token, resyncs). Only within two steps of a draft from a long
    match (a copy, not a coincidence of common tokens), and never after a resync's draft."""

    __slots__ = ("max_depth", "spec_factor", "min_prob", "resync", "tokens", "followers", "last")

    def __init__(self, max_depth: int, spec_factor: float, min_prob: float, resync: bool = False) -> None:
        self.max_depth, self.spec_factor, self.min_prob, self.resync = max_depth, spec_factor, min_prob, resync
        self.tokens: list[int] = []
        self.followers: dict[tuple[int, int], list[int]] = {}
        self.last: tuple[SuffixDraft, int] | None = None  # the last draft and the context's length then

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; each gram that now has a follower records its position."""
        seq, followers = self.tokens, self.followers
        start = len(seq)
        seq.extend(tokens)
        for p in range(max(start, KEY), len(seq)):
            key = (seq[p - 2], seq[p - 1])
            at = followers.get(key)
            if at is None:
                followers[key] = [p]
            else:
                at.append(p)

    def speculate(self, context: list[int], k: int) -> SuffixDraft:
        """The best draft of at most k tokens to follow context, over every match length; with resync, else the
        tokens after context's last one near where the last draft was read."""
        if k <= 0 or len(context) < KEY:
            return NO_DRAFT
        draft = self._match(context, k)
        if self.resync:
            if not draft.tokens and self.last is not None:
                draft = self._resync(context, k, *self.last)
            if draft.tokens:
                self.last = (draft, len(context))
        return draft

    def _resync(self, context: list[int], k: int, last: SuffixDraft, at: int) -> SuffixDraft:
        """After a draft from a long match, read at ``last.start`` for a context of ``at`` tokens: the tokens after
        the first place from where the copy would stand now (moved on by what context gained) where the text
        holds context's last token, within ``RESYNC_WINDOW``."""
        gained = len(context) - at
        if last.match < RESYNC_MIN_MATCH or gained > len(last.tokens) + 2:
            return NO_DRAFT
        seq, token, start = self.tokens, context[-1], last.start + gained - 1
        for q in range(start, min(start + RESYNC_WINDOW, len(seq) - 1)):
            if seq[q] == token:
                return SuffixDraft(seq[q + 1:q + 1 + k], 0.0, q + 1)
        return NO_DRAFT

    def _match(self, context: list[int], k: int) -> SuffixDraft:
        occurrences = self.followers.get((context[-2], context[-1]))
        if not occurrences:
            return NO_DRAFT
        seq, occ = self.tokens, occurrences[-MAX_OCCURRENCES:]
        best, length, walked = NO_DRAFT, KEY, (0, -1)
        longest = min(self.max_depth, len(context))
        while True:
            if len(occ) == 1:  # one occurrence left: the match runs back as far as the two agree
                p = occ[0]
                while length < longest and length < p and seq[p - length - 1] == context[-length - 1]:
                    length += 1
            cap = min(k, int(length * self.spec_factor + 1e-6))
            if (len(occ), cap) != walked:
                walked = (len(occ), cap)
                draft = self._walk(occ, cap, length)
                if draft.score >= best.score and draft.tokens:
                    best = draft
            elif best is draft:  # a longer match with the same occurrences and cap drafts the same: its length
                best = draft = replace(draft, match=length)
            if len(occ) == 1 or length >= longest:
                return best
            length += 1
            want = context[-length]
            occ = [p for p in occ if p >= length and seq[p - length] == want]
            if not occ:
                return best

    def _walk(self, occ: list[int], cap: int, match: int) -> SuffixDraft:
        """Up to cap tokens: at each step the token most of the occurrences still on the path continue with (the
        latest on a tie), while the share of occurrences on the path stays >= min_prob."""
        seq, end = self.tokens, len(self.tokens)
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        for i in range(cap):
            counts: dict[int, int] = {}
            for p in reversed(occ):
                if p + i < end and (t := seq[p + i]) != SEPARATOR:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            prob *= counts[token] / len(occ)
            if prob < self.min_prob:
                break
            tokens.append(token)
            score += prob
            if counts[token] < len(occ):
                occ = [p for p in occ if p + i < end and seq[p + i] == token]
        return SuffixDraft(tokens, score, occ[-1], match)


class RecentSuffixes:
    """The outputs of recently finished requests as one ``SuffixIndex`` (the paper's global tree): agents, templated
    answers and retried requests repeat earlier answers. Bounded by ``max_requests`` outputs and ``max_tokens``
    tokens: past either, the older half of the outputs is dropped and the index rebuilt."""

    __slots__ = ("max_requests", "max_tokens", "outputs", "total", "index")

    def __init__(self, max_requests: int, max_depth: int, spec_factor: float, min_prob: float,
                 max_tokens: int = 1 << 16) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.outputs: list[list[int]] = []
        self.total = 0
        self.index = SuffixIndex(max_depth, spec_factor, min_prob)

    def add(self, tokens: list[int]) -> None:
        if len(tokens) <= KEY:
            return
        tokens = tokens[-max(1, self.max_tokens // 2 - 1):]  # an output fits the half kept
        self.outputs.append(tokens)
        self.total += len(tokens) + 1
        if self.total <= self.max_tokens and len(self.outputs) <= self.max_requests:
            self.index.extend([*tokens, SEPARATOR])
            return
        self.outputs, self.total = newest_half(self.outputs, self.max_tokens, self.max_requests)
        index = self.index
        self.index = SuffixIndex(index.max_depth, index.spec_factor, index.min_prob)
        for out in self.outputs:
            self.index.extend([*out, SEPARATOR])

    def speculate(self, context: list[int], k: int) -> SuffixDraft:
        return self.index.speculate(context, k)
