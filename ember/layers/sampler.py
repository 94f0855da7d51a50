"""One batched sampler for every request of a step.

Order, as in transformers: penalties, then the min_tokens / no-repeat-n-gram / bad-words masks, then temperature,
top-k, top-p, min-p, then a draw.
Greedy rows take the argmax. A draw is ``argmax(probs / Exp(1) noise)`` (the Gumbel trick): each seeded request
draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.core.sequence import Sequence
from ember.layers.logits_processors import (NGramIndex, apply_presence_frequency, apply_repetition_penalty,
                                            bad_word_tokens, mask_tokens, token_counts)


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


_CANDIDATES = 512  # top-k/top-p look at this many best tokens and rank a whole row only if they fall short


@dataclass(slots=True)
class Candidates:
    """The tokens a row may still draw: logits (-inf where removed) and their token ids, both [B, C]."""

    logits: torch.Tensor
    ids: torch.Tensor


def filter_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> Candidates:
    """Apply top-k (0 = off), top-p (1 = off) and min-p (0 = off) with transformers' definitions: ties at the k-th
    logit are kept; top-p drops a token once the tokens ranked above it hold top_p of the mass; min-p drops tokens
    below min_p times the best one's probability. logits [B, V], already divided by the temperature.

    Ranking a whole 49k-token row costs ~2 ms on CPU; ``topk`` of the best few hundred is ~20x cheaper and exact
    whenever they hold top_p of the mass (the usual case); otherwise the rows are sorted in full."""
    B, V = logits.shape
    use_k, use_p, use_min = top_k > 0, top_p < 1, min_p > 0
    if not (bool(use_k.any()) or bool(use_p.any())):
        vals, ids = logits, torch.arange(V, device=logits.device).expand(B, V)
    else:
        # a row that uses neither keeps its whole vocabulary (the sampler sends such rows separately)
        cap = min(V, max(_CANDIDATES, int(top_k.max()))) if bool((use_k | use_p).all()) else V
        vals, ids = logits.topk(cap, dim=-1)
        if bool(use_p.any()):
            lse = _kept_logsumexp(logits, vals, use_k, top_k)
            if bool((use_p & ((vals - lse).exp().sum(dim=-1) < top_p)).any()):
                vals, ids = logits.sort(dim=-1, descending=True)
        if bool(use_k.any()):
            kth = vals.gather(1, (torch.where(use_k, top_k, 1).clamp(max=vals.shape[1]) - 1)[:, None])
            vals = vals.masked_fill(use_k[:, None] & (vals < kth), float("-inf"))
        if bool(use_p.any()):
            probs = (vals - lse).exp()
            above = probs.cumsum(dim=-1) - probs
            remove = (above >= top_p[:, None]) & use_p[:, None]
            remove[:, 0] = False
            vals = vals.masked_fill(remove, float("-inf"))
    if bool(use_min.any()):  # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        floor = vals.max(dim=-1, keepdim=True).values + min_p.clamp(min=1e-30).log()[:, None]
        vals = vals.masked_fill(use_min[:, None] & (vals < floor), float("-inf"))
    return Candidates(vals, ids)


def _kept_logsumexp(logits: torch.Tensor, vals: torch.Tensor, use_k: torch.Tensor,
                    top_k: torch.Tensor) -> torch.Tensor:
    """logsumexp over what top-k keeps (all of it lies among the candidates), or over the whole row."""
    ranks = torch.arange(vals.shape[1], device=vals.device)[None, :]
    in_k = vals.masked_fill(use_k[:, None] & (ranks >= top_k[:, None]), float("-inf")).logsumexp(-1, keepdim=True)
    return torch.where(use_k[:, None], in_k, logits.logsumexp(-1, keepdim=True))


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits [B, V] float32, one row per sequence to sample."""
        B, V = logits.shape
        device = logits.device
        params = [s.request.params for s in seqs]
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = logits.log_softmax(dim=-1) if max_lp is not None else None

        logits = self._process(logits, seqs)
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        # rows that filter their candidates, and rows that draw from the whole vocabulary, go separately
        filtered = [i for i in rand_rows if params[i].top_k > 0 or params[i].top_p < 1]
        for group in (filtered, [i for i in rand_rows if i not in set(filtered)]):
            if group:
                idx = torch.tensor(group, device=device)
                tokens[idx] = self._draw(logits[idx], [seqs[i] for i in group])
        token_list = tokens.tolist()

        lps: list[TokenLogprobs | None] = [None] * B
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
            top_vals, top_ids = raw_logprobs.topk(max_lp, dim=-1) if max_lp else (None, None)
            chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                k = p.logprobs
                lps[i] = TokenLogprobs(chosen_l[i], ranks_l[i],
                                       top_ids[i, :k].tolist() if k else [], top_vals[i, :k].tolist() if k else [])
        return SamplerOutput(token_list, lps)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one token per row: argmax(p / E) with E ~ Exp(1) (the Gumbel trick, exact).

        A seeded row draws noise for the whole vocabulary from its own generator and reads it at its candidates,
        so its tokens do not depend on the batch, nor on how many candidates were ranked."""
        device = logits.device
        params = [s.request.params for s in seqs]
        f32 = dict(dtype=torch.float32, device=device)
        logits = logits / torch.tensor([p.temperature for p in params], **f32)[:, None]
        cand = filter_candidates(
            logits,
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], **f32),
            torch.tensor([p.min_p for p in params], **f32),
        )
        probs = cand.logits.softmax(dim=-1)
        uniform = torch.rand_like(probs)  # -log(U) ~ Exp(1); rand is far cheaper than exponential_ on CPU
        for j, s in enumerate(seqs):
            if s.generator is not None:
                uniform[j] = torch.rand(self.vocab_size, generator=s.generator).to(device)[cand.ids[j]]
        choice = (probs / -uniform.log()).argmax(dim=-1, keepdim=True)
        return cand.ids.gather(1, choice).squeeze(1)

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.request.params for s in seqs]
        device = logits.device
        rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if rows:
            idx = torch.tensor(rows, device=device)
            sub = logits[idx]
            f32 = dict(dtype=torch.float32, device=device)
            rep = torch.tensor([params[i].repetition_penalty for i in rows], **f32)
            if bool((rep != 1).any()):
                seen = token_counts([seqs[i].output_token_ids if params[i].repetition_penalty_output_only
                                     else seqs[i].token_ids for i in rows], self.vocab_size, device) > 0
                sub = apply_repetition_penalty(sub, seen, rep)
            pres = torch.tensor([params[i].presence_penalty for i in rows], **f32)
            freq = torch.tensor([params[i].frequency_penalty for i in rows], **f32)
            if bool((pres != 0).any() or (freq != 0).any()):
                counts = token_counts([seqs[i].output_token_ids for i in rows], self.vocab_size, device)
                sub = apply_presence_frequency(sub, counts, pres, freq)
            logits = logits.index_copy(0, idx, sub)
        banned: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            p = params[i]
            if s.num_output_tokens < p.min_tokens:
                banned[i] = list(p.eos_token_ids) + p.stop_token_ids
            if p.bans_tokens:
                ids = banned.setdefault(i, [])
                if p.no_repeat_ngram_size:
                    if s.ngram_index is None:
                        s.ngram_index = NGramIndex(p.no_repeat_ngram_size)
                    ids.extend(s.ngram_index.banned(s.token_ids))
                ids.extend(bad_word_tokens(s.token_ids, p.bad_words_ids))
        if banned:
            logits = logits.clone() if not rows else logits
            rows_b = list(banned)
            mask_tokens(logits, rows_b, [banned[i] for i in rows_b])
        return logits
