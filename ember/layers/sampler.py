"""One batched sampler for every request of a step.

Order: the structured-output mask (tokens the request's grammar does not allow are removed), then, as in
transformers, penalties, then the min_tokens / no-repeat-n-gram / bad-words masks, then temperature,
top-k, top-p, min-p, then a draw.
Greedy rows take the argmax. A draw is ``argmax(probs / Exp(1) noise)`` (the Gumbel trick): a seeded sample's noise
for its output token i comes from a generator seeded with (seed, i) alone, so its tokens depend neither on what
else is in the batch nor on how many tokens a step computes (a speculative step samples several positions at once
and keeps the ones a one-token step would have drawn).
Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ember.layers.logits_processors import DEFAULT_PROCESSORS, LogitsProcessor, RowState
from ember.protocol import SamplingRow, TokenLogprobs, TokenMaskSource


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # beam-search rows: row -> (token ids, log-probabilities) of its best continuations, best first
    beams: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)


_BIT = torch.arange(32, dtype=torch.int32)


def apply_token_masks(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of logits [B, V] with every token their bitmask (int32 [len(rows), W], 32 tokens a word) does
    not allow set to -inf; tokens past the mask's 32 * W are not allowed."""
    V = logits.shape[1]
    allowed = ((bits.to(logits.device)[:, :, None] >> _BIT.to(logits.device)) & 1).flatten(1).bool()
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    idx = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, idx, logits[idx].masked_fill(~allowed[:, :V], float("-inf")))


_CHUNK = 1024


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximal index of each row, NaN counting as the maximum), faster on CPU:
    torch's CPU argmax does not vectorize (3 ms for 64 rows of 49k logits, 15x a sum), so the rows are cut into
    1,024-logit chunks, the chunks' maxima (a fast reduction) pick each row's chunk, and argmax runs on that one.
    Faster from one row on (AMD Zen 5, 2 threads, one row: 262,144 float32 logits 139 -> 23 us, bf16 839 -> 46;
    49,152 float32 27 -> 18 us)."""
    B, V = logits.shape
    n = V // _CHUNK
    if logits.device.type != "cpu" or n < 2:
        return logits.argmax(dim=-1)
    head = logits[:, :n * _CHUNK].reshape(B, n, _CHUNK)
    chunk_max = head.amax(dim=-1)  # [B, n]
    chunk = chunk_max.argmax(dim=-1)  # the first chunk holding the row's maximum
    best = chunk_max.gather(1, chunk[:, None]).squeeze(1)
    tokens = chunk * _CHUNK + head[torch.arange(B, device=logits.device), chunk].argmax(dim=-1)
    if n * _CHUNK < V:  # the tail wins only with a larger value (or NaN where the head has none)
        tail_val, tail_idx = logits[:, n * _CHUNK:].max(dim=-1)
        tokens = torch.where((tail_val > best) | (tail_val.isnan() & ~best.isnan()), n * _CHUNK + tail_idx, tokens)
    return tokens


_MASK63 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded sample's draw of output token ``position``: splitmix64's finaliser over the pair, so
    nearby seeds and positions give unrelated generator states."""
    z = ((seed & 0xFFFFFFFFFFFFFFFF) * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


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
    """Samples one token per row from plain rows (``SamplingRow``) and their states; reads no engine object."""

    def __init__(self, vocab_size: int, processors: tuple[LogitsProcessor, ...] = DEFAULT_PROCESSORS,
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.processors = processors
        self.seed = seed
        # unseeded rows' noise, one generator per device: not the process's default one, which another engine, the
        # user, or a CUDA graph capture elsewhere in the process (it marks the default CUDA generator as capturing,
        # for good if that capture fails) would share
        self._noise: dict[torch.device, torch.Generator] = {}
        self._seeded = torch.Generator()  # reseeded for each seeded row's draw (position_seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], states: list[RowState],
                 masks: TokenMaskSource | None = None) -> SamplerOutput:
        """logits [B, V] float32, one row per sample; masks: the guided rows' allowed tokens."""
        B, V = logits.shape
        device = logits.device
        params = [r.params for r in rows]
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = logits.log_softmax(dim=-1) if max_lp is not None else None
        beam_rows = [i for i, p in enumerate(params) if p.use_beam_search]
        if beam_rows:  # as transformers: log-softmax first (of logits / temperature, as vLLM), processors after
            beam_idx = torch.tensor(beam_rows, device=device)
            temps = torch.tensor([params[i].temperature or 1.0 for i in beam_rows], dtype=logits.dtype, device=device)
            logits = logits.index_copy(0, beam_idx, (logits[beam_idx] / temps[:, None]).log_softmax(dim=-1))
        if masks is not None:
            logits = apply_token_masks(logits, masks.rows, masks.get())

        for proc in self.processors:
            wanted = [i for i, p in enumerate(params) if proc.wants(p)]
            if wanted:
                logits = proc(logits, wanted, rows, states)
        tokens = greedy_tokens(logits)
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy and not p.use_beam_search]
        # rows that filter their candidates, and rows that draw from the whole vocabulary, go separately
        filtered = [i for i in rand_rows if params[i].top_k > 0 or params[i].top_p < 1]
        for group in (filtered, [i for i in rand_rows if i not in set(filtered)]):
            if group:
                idx = torch.tensor(group, device=device)
                tokens[idx] = self._draw(logits[idx], [rows[i] for i in group], [states[i] for i in group])
        token_list = tokens.tolist()
        beams: dict[int, tuple[list[int], list[float]]] = {}
        if beam_rows:
            k = min(V, max(params[i].beam_candidates for i in beam_rows))
            vals, ids = logits[beam_idx].topk(k, dim=-1)
            for j, i in enumerate(beam_rows):
                kk = min(k, params[i].beam_candidates)
                beams[i] = (ids[j, :kk].tolist(), vals[j, :kk].tolist())

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
        return SamplerOutput(token_list, lps, beams)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._noise.get(device)
        if gen is None:
            gen = self._noise[device] = torch.Generator(device).manual_seed(self.seed)
        return gen

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], states: list[RowState]) -> torch.Tensor:
        """Sample one token per row: argmax(p / E) with E ~ Exp(1) (the Gumbel trick, exact).

        A seeded row draws noise for the whole vocabulary from a generator seeded with (its seed, its output
        position) and reads it at its candidates, so its tokens do not depend on the batch, nor on how many
        candidates were ranked, nor on the other positions a step samples."""
        device = logits.device
        params = [r.params for r in rows]
        f32 = dict(dtype=torch.float32, device=device)
        logits = logits / torch.tensor([p.temperature for p in params], **f32)[:, None]
        cand = filter_candidates(
            logits,
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], **f32),
            torch.tensor([p.min_p for p in params], **f32),
        )
        probs = cand.logits.softmax(dim=-1)
        # -log(U) ~ Exp(1); rand is far cheaper than exponential_ on CPU
        uniform = torch.rand(probs.shape, generator=self._generator(device), **f32)
        for j, st in enumerate(states):
            if st.seed is not None:
                gen = self._seeded.manual_seed(position_seed(st.seed, rows[j].num_output_tokens))
                uniform[j] = torch.rand(self.vocab_size, generator=gen).to(device)[cand.ids[j]]
        choice = (probs / -uniform.log()).argmax(dim=-1, keepdim=True)
        return cand.ids.gather(1, choice).squeeze(1)


def rank_logprobs(logprobs: torch.Tensor, chosen_ids: list[int], k: int) -> list[TokenLogprobs]:
    """For rows of log-probabilities and the token each row scored: its logprob, its rank, and the top k."""
    if logprobs.shape[0] == 0:
        return []
    ids = torch.tensor(chosen_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    return [TokenLogprobs(v, ranks[i], top_ids[i].tolist() if k else [], top_vals[i].tolist() if k else [])
            for i, v in enumerate(chosen.tolist())]
