"""Logits processors applied before sampling, batched over the rows that need them.

- repetition_penalty: transformers semantics, over prompt and output tokens: a seen token's logit is divided by
  the penalty when positive and multiplied when negative;
- presence / frequency penalty: OpenAI semantics, over output tokens only: logit -= presence * (count > 0)
  + frequency * count;
- min_tokens: EOS and stop_token_ids are masked until that many tokens were generated;
- no_repeat_ngram_size / bad_words_ids: transformers semantics (NoRepeatNGramLogitsProcessor over prompt and
  output; NoBadWordsLogitsProcessor: a one-token bad word is always banned, a longer one's last token is banned when
  the sequence ends with the rest of it);
- thinking_token_budget: past the budget inside a ``<think>`` block, the block's end tag is forced.

Each sits behind one protocol, ``LogitsProcessor``: it says which rows want it and rewrites their logits. What a
processor remembers between steps (the penalties' token counts, the n-gram index) lives in the row's ``RowState``,
which belongs to the sample: the worker keeps it under the sample's handle until the engine core releases it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ember.protocol import SamplingRow
from ember.sampling_params import SamplingParams


class RowState:
    """What a sample's sampling remembers between steps: its seed and the processors' state."""

    __slots__ = ("seed", "ngram", "counts", "counted", "thinking")

    def __init__(self, seed: int | None) -> None:
        self.seed = seed  # a seeded sample's draw of output token i depends on (seed, i) only
        self.ngram: NGramIndex | None = None
        self.thinking: ThinkingScan | None = None
        self.counts: torch.Tensor | None = None  # penalties: [2, V] counts of every token and of output tokens
        self.counted = 0  # tokens of the sample already in counts

    def token_counts(self, row: SamplingRow, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[2, V]: how often each token occurs in the whole sequence and in its output, updated in place with the
        tokens added since the last step (a step costs O(new tokens), not O(length)); a verifying row's drafted
        tokens are not counted (``Penalties`` adds them to its copy)."""
        if self.counts is None:
            self.counts = torch.zeros(2, vocab_size, dtype=torch.float32, device=device)
        tokens, start, end = row.token_ids, self.counted, len(row.token_ids) - row.num_draft
        if end > start:
            new = torch.tensor(tokens[start:end], dtype=torch.long, device=device)
            self.counts[0].index_add_(0, new, torch.ones(len(new), device=device))
            out = new[max(0, row.num_prompt_tokens - start):]
            self.counts[1].index_add_(0, out, torch.ones(len(out), device=device))
            self.counted = end
        return self.counts


class LogitsProcessor(Protocol):
    def wants(self, params: SamplingParams) -> bool:
        """Whether a row with these parameters needs this processor at all."""

    def __call__(self, logits: torch.Tensor, rows: list[int], batch: list[SamplingRow],
                 states: list[RowState]) -> torch.Tensor:
        """logits [B, V] of the whole batch -> new logits; only the given rows change."""


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool; penalty [B]."""
    p = penalty[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """counts [B, V] of output tokens; presence/frequency [B]."""
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def mask_tokens(logits: torch.Tensor, rows: list[int], token_lists: list[list[int]]) -> None:
    """Set the given tokens of the given rows to -inf, in place."""
    for row, ids in zip(rows, token_lists):
        valid = [i for i in ids if i < logits.shape[1]]
        if valid:
            logits[row, valid] = float("-inf")


class NGramIndex:
    """Every n-gram of a growing token list, as (n-1)-token prefix -> tokens that followed it; updated only with
    the tokens added since the last call, so a step costs O(new tokens), not O(length)."""

    __slots__ = ("n", "upto", "table")

    def __init__(self, n: int) -> None:
        self.n, self.upto, self.table = n, 0, {}

    def banned(self, tokens: list[int], num_draft: int = 0) -> set[int]:
        """Tokens that would repeat an n-gram if appended to tokens; the last num_draft tokens (a draft being
        verified) count for this call only, the index keeps the rest."""
        n, kept = self.n, len(tokens) - num_draft
        for end in range(max(self.upto, n), kept + 1):  # n-gram tokens[end - n:end]
            self.table.setdefault(tuple(tokens[end - n:end - 1]), set()).add(tokens[end - 1])
        self.upto = kept + 1
        if len(tokens) + 1 < n:
            return set()
        key = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
        out = self.table.get(key, set())
        tail = {tokens[end - 1] for end in range(max(kept + 1, n), len(tokens) + 1)
                if tuple(tokens[end - n:end - 1]) == key}  # the draft's own n-grams
        return out | tail if tail else out


def bad_word_tokens(tokens: list[int], bad_words: list[list[int]]) -> list[int]:
    """The last token of each bad word whose other tokens end the sequence (all one-token bad words)."""
    out = []
    for word in bad_words:
        k = len(word) - 1
        if k == 0 or (len(tokens) >= k and tokens[len(tokens) - k:] == word[:-1]):
            out.append(word[-1])
    return out


class Penalties:
    """repetition_penalty, presence_penalty and frequency_penalty, batched over the rows that use them."""

    def wants(self, params: SamplingParams) -> bool:
        return params.needs_penalties

    def __call__(self, logits: torch.Tensor, rows: list[int], batch: list[SamplingRow],
                 states: list[RowState]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        params = [batch[i].params for i in rows]
        idx = torch.tensor(rows, device=device)
        sub = logits[idx]
        f32 = dict(dtype=torch.float32, device=device)
        counts = torch.stack([states[i].token_counts(batch[i], vocab, device) for i in rows])  # [R, 2, V]
        for r, i in enumerate(rows):  # a verifying row's drafted tokens, all output tokens, in this copy only
            if batch[i].num_draft:
                drafted = torch.tensor(batch[i].token_ids[-batch[i].num_draft:], dtype=torch.long, device=device)
                counts[r].index_add_(1, drafted, torch.ones(2, len(drafted), device=device))
        rep = torch.tensor([p.repetition_penalty for p in params], **f32)
        if bool((rep != 1).any()):
            which = torch.tensor([1 if p.repetition_penalty_output_only else 0 for p in params], device=device)
            seen = counts[torch.arange(len(rows), device=device), which] > 0
            sub = apply_repetition_penalty(sub, seen, rep)
        pres = torch.tensor([p.presence_penalty for p in params], **f32)
        freq = torch.tensor([p.frequency_penalty for p in params], **f32)
        if bool((pres != 0).any() or (freq != 0).any()):
            sub = apply_presence_frequency(sub, counts[:, 1], pres, freq)
        return logits.index_copy(0, idx, sub)


class TokenBans:
    """min_tokens (EOS and stop ids masked), no_repeat_ngram_size and bad_words_ids: one masking pass."""

    def wants(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0 or params.bans_tokens

    def __call__(self, logits: torch.Tensor, rows: list[int], batch: list[SamplingRow],
                 states: list[RowState]) -> torch.Tensor:
        banned: dict[int, list[int]] = {}
        for i in rows:
            row, p = batch[i], batch[i].params
            if row.num_output_tokens < p.min_tokens:
                banned[i] = list(p.eos_token_ids) + p.stop_token_ids
            if p.bans_tokens:
                ids = banned.setdefault(i, [])
                if p.no_repeat_ngram_size:
                    if states[i].ngram is None:
                        states[i].ngram = NGramIndex(p.no_repeat_ngram_size)
                    ids.extend(states[i].ngram.banned(row.token_ids, row.num_draft))
                ids.extend(bad_word_tokens(row.token_ids, p.bad_words_ids))
        if banned:
            logits = logits.clone()
            mask_tokens(logits, list(banned), list(banned.values()))
        return logits


class ThinkingScan:
    """Where a sample's open thinking block starts (the index after its start tag; -1: none open), updated with the
    tokens added since the last step."""

    __slots__ = ("scanned", "start")

    def __init__(self, first: int = 0) -> None:
        self.scanned, self.start = first, -1  # tags ending before token ``first`` are not looked at

    def update(self, tokens: list[int], start_tag: tuple[int, ...], end_tag: tuple[int, ...],
               num_draft: int = 0) -> int:
        """The open block's start after tokens; the last num_draft (a draft being verified) are scanned for this
        call only."""
        kept = len(tokens) - num_draft
        self._scan(tokens, kept, start_tag, end_tag)
        if not num_draft:
            return self.start
        ahead = ThinkingScan()
        ahead.scanned, ahead.start = self.scanned, self.start
        ahead._scan(tokens, len(tokens), start_tag, end_tag)
        return ahead.start

    def _scan(self, tokens: list[int], upto: int, start_tag: tuple[int, ...], end_tag: tuple[int, ...]) -> None:
        for end in range(self.scanned + 1, upto + 1):  # a tag ending at tokens[end - 1]
            if _ends(tokens, end, start_tag):
                self.start = end
            elif self.start >= 0 and end - len(end_tag) >= self.start and _ends(tokens, end, end_tag):
                self.start = -1
        self.scanned = max(self.scanned, upto)


def _ends(tokens: list[int], end: int, tag: tuple[int, ...]) -> bool:
    return end >= len(tag) and tuple(tokens[end - len(tag):end]) == tag


class ThinkingBudget:
    """thinking_token_budget: once a sample has spent its budget of output tokens inside a thinking block, the
    block's end tag is forced, token by token (the rest of the vocabulary masked), and the answer follows."""

    def wants(self, params: SamplingParams) -> bool:
        return params.thinking_token_budget is not None

    def __call__(self, logits: torch.Tensor, rows: list[int], batch: list[SamplingRow],
                 states: list[RowState]) -> torch.Tensor:
        forced: dict[int, int] = {}
        for i in rows:
            row, p = batch[i], batch[i].params
            start_tag, end_tag = p.thinking_tags
            # a block opens in the output or at the end of the prompt (the generation prompt's tag and a few
            # whitespace tokens after it), never in the conversation before it
            scan = states[i].thinking = states[i].thinking or ThinkingScan(
                max(0, row.num_prompt_tokens - len(start_tag) - len(end_tag) - 4))
            start = scan.update(row.token_ids, start_tag, end_tag, row.num_draft)
            if start < 0 or len(row.token_ids) - max(start, row.num_prompt_tokens) < p.thinking_token_budget:
                continue
            # the end tag's next token: after the longest part of it the output already ends with
            done = next((k for k in range(len(end_tag) - 1, 0, -1) if _ends(row.token_ids, len(row.token_ids),
                                                                          end_tag[:k])), 0)
            forced[i] = end_tag[done]
        if not forced:
            return logits
        idx = torch.tensor(list(forced), device=logits.device)
        keep = torch.tensor(list(forced.values()), device=logits.device)
        sub = torch.full((len(forced), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        sub[torch.arange(len(forced), device=logits.device), keep] = 0.0  # even where a mask before removed it
        return logits.index_copy(0, idx, sub)


# in transformers' order: penalties, then the masks; the thinking budget last (it may force one token)
DEFAULT_PROCESSORS: tuple[LogitsProcessor, ...] = (Penalties(), TokenBans(), ThinkingBudget())
