"""Speculative decoding's engine-core half: before each step, drafts for the decoding sequences that may speculate;
after it, what each draft's verification taught.

A draft of k tokens makes a decoding row compute 1 + k tokens in one forward pass (a short prefill span over the
paged KV cache); the worker samples every position as it would without speculation and the row keeps the drafts up
to the first that differs from its sample, plus that sample. Accepting exactly the drafts the sampler would have
produced keeps the output what decoding one token a step gives, token for token (greedy, and seeded sampling since
a draw depends only on the seed and the position), and the distribution for unseeded sampling.

How many tokens to draft: verifying a draft of k tokens costs a batch-1 step ``verify_costs[k] - 1`` more, as
timed on this machine at start-up (``worker.verify_cost``; the row runs as a short prefill span, and every drafted
token adds its compute and its logits), or ``DRAFT_STEP_COST + k * DRAFT_TOKEN_COST`` where nothing was timed; in a
step of B decoding rows that extra weighs B (F + 1) / (F + B) times as much against the row's share of the step,
F = ``FIXED_COST_ROWS`` (the weights' read, in rows' worth). With per-token acceptance a the row gains
1 + a + ... + a^k tokens. Each request keeps a decaying estimate of a (so a request that stopped
matching is tried again later) and drafts the k in [0, num_speculative_tokens] that maximises gain per cost, and
at most 2 + twice what its last draft kept: a copy that ends costs one long rejected draft, not several.
Beam searches do not draft. A request whose sampling reads the token history (penalties, bans, a thinking budget)
verifies each position with the drafted tokens before it in its history; a guided one (structured output) drafts
only what its grammar allows (``DraftCheck``), free drafts only (a draft model's tokens are made in the step, after
the masks), and its masks follow the draft.
A request whose own tokens give no n-gram draft looks up its last ``prompt_lookup_max`` tokens in the outputs of
recently finished requests with its prefix-cache salt (``ngram.RecentOutputs``). With ``method="suffix"`` the
lookup is suffix decoding's: the request's own ``suffix.SuffixIndex`` and the recent outputs'
(``suffix.RecentSuffixes``) both draft, and the draft with more expected kept tokens goes.

A request with a prediction (OpenAI's predicted outputs) drafts from it first: the prediction's next tokens while
the output is still a copy of its start, else the tokens after the output's last 1..prompt_lookup_max tokens in it.
Predictions draft also on an engine without ``speculative_config`` (then nothing else drafts).

With a draft model (``method="draft_model"``) free drafts still go first: a row whose prediction or lookup finds
tokens drafts those (a copy costs nothing to draft; the model would spend a step a token on it). Elsewhere the core
decides k for the model, counting each drafted token's cost to make (``WorkerInfo.draft_cost``, measured at
start-up), and sends k placeholders: the worker's drafter fills them in the step and returns its tokens with the
sampled ones (``worker.drafter``). Free drafts (prediction, lookup) share one acceptance estimate per request, the
model has its own; while free drafts run, the model's estimate stands still. The draft model's KV lacks what it was
never fed (a new sequence's whole prompt; the tokens of steps that drafted otherwise): where a sequence lacks more
than the step's catch-up budget (``WorkerInfo.draft_catch_up`` tokens, about a decode step's worth, shared by the
step's rows) it drafts nothing and is ordered that many tokens fed (``SchedulerOutput.draft_catch_up``), so a long
prompt's catch-up spreads over steps instead of stalling one for every row of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ember.config import SpeculativeConfig
from ember.core.ngram import NgramIndex, RecentOutputs
from ember.core.request import Sequence
from ember.core.suffix import RecentSuffixes, SuffixIndex
from ember.protocol import DRAFT_PLACEHOLDER

# a verifying row's extra over a batch-1 decode step where start-up timed none (several ranks, CUDA, predictions without
# speculative_config), as measured on a 2-core Xeon with AMX (docs/speculative.md): 1 + 0.12 to 0.22 with one
# drafted token, 1.23 to 1.31 with eight (SmolLM2-135M Q4_1, Qwen2.5-Coder-1.5B Q4_K_M)
DRAFT_STEP_COST = 0.15
DRAFT_TOKEN_COST = 0.025
# a batch-1 step's weight read in rows' worth of compute: 8 (SmolLM2) to 16 (1.5B), from decode steps at 1 and 32 rows
FIXED_COST_ROWS = 12.0
DEFAULT_MAX_BATCH = 16  # decoding rows above which no row drafts (disable_by_batch_size's default)
# per verification older counts fade, so the estimate follows about the last 3 drafts, and a request whose drafts
# are all rejected settles at a = 0.5 / (1 / (1 - 0.7) + 1) = 0.12, where no draft pays
_DECAY = 0.7
_IDLE_DECAY = 0.97  # per step without a draft: the estimate drifts back to the prior, so the request tries again
_PRIOR_ACCEPT, _PRIOR_TRIES = 0.5, 1.0  # a = 0.5 before anything is measured
# a draft model starts from a = 0.7: a smaller model of the target's family agrees on most tokens (0.5 would never
# pay for its drafting steps, so nothing would ever be measured)
_PRIOR_ACCEPT_DRAFT_MODEL = 0.7
MAX_RECENT_SALTS = 8  # prefix-cache salts whose recent outputs are kept for n-gram lookup


@dataclass(slots=True)
class _Estimate:
    """One draft source's decaying acceptance estimate for one request."""

    prior: float = _PRIOR_ACCEPT
    accepted: float = 0.0  # decayed counts: drafts accepted, positions tried
    tried: float = 0.0
    last_kept: int = 1 << 30  # what the last verified draft kept (none yet: no cap)

    @property
    def acceptance(self) -> float:
        return (self.accepted + self.prior * _PRIOR_TRIES) / (self.tried + _PRIOR_TRIES)

    def k(self, weight: float, most: int, room: int, draft_cost: float = 0.0,
          costs: tuple[float, ...] | None = None) -> int:
        """The draft length this estimate pays for, within room and 2 + twice the last draft's kept tokens."""
        return min(best_k(self.acceptance, weight, most, draft_cost, costs), room, 2 + 2 * self.last_kept)

    def idle(self) -> None:
        """A step this source did not pay for: the estimate drifts back to the prior, so it is tried again."""
        self.accepted *= _IDLE_DECAY
        self.tried *= _IDLE_DECAY

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: ``accepted`` of its ``drafted`` tokens kept (a rejection counts its position tried)."""
        self.accepted = self.accepted * _DECAY + accepted
        self.tried = self.tried * _DECAY + min(accepted + 1, drafted)
        self.last_kept = accepted


@dataclass(slots=True)
class _SeqState:
    index: NgramIndex | SuffixIndex  # the sequence's own tokens: SuffixIndex with method="suffix"
    prediction: NgramIndex | None = None  # the request's predicted output, indexed
    copied: int = 0  # output tokens known to equal the prediction's start; -1: the output left it
    lookup: _Estimate = field(default_factory=_Estimate)  # drafts free to make: the prediction's, the lookup's
    model: _Estimate | None = None  # the draft model's (None: no draft model)
    pending: _Estimate | None = None  # the source of the draft being verified
    fed: int = 0  # the sequence's first tokens the draft model's KV holds, as this core ordered them


@dataclass(slots=True)
class SpeculationCounts:
    drafts: int = 0  # verifications (rows that ran with a draft)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # position i: drafts whose i-th token was kept


def draft_weight(rows: int) -> float:
    """How much a drafting row's extra weighs against its share of a step of ``rows`` decoding rows (1 at batch 1)."""
    return rows * (FIXED_COST_ROWS + 1) / (FIXED_COST_ROWS + rows)


def verify_extra(k: int, costs: tuple[float, ...] | None = None) -> float:
    """What verifying k drafted tokens adds to a batch-1 decode step, in steps: timed (``costs``, past its end
    growing as its last two entries do) or the Xeon's constants."""
    if costs is None:
        return DRAFT_STEP_COST + k * DRAFT_TOKEN_COST
    last = len(costs) - 1
    if k <= last:
        return costs[k] - 1.0
    return costs[last] - 1.0 + (k - last) * (costs[last] - costs[last - 1] if last else DRAFT_TOKEN_COST)


def best_k(acceptance: float, weight: float, most: int, draft_cost: float = 0.0,
           costs: tuple[float, ...] | None = None) -> int:
    """The draft length in [0, most] with the most expected tokens per unit of the row's cost:
    (1 + a + ... + a^k) / (1 + weight * verify_extra(k) + k * draft_cost); 0 when no draft pays. draft_cost: a
    draft model's step against the target's (0: lookup drafts cost nothing to make); costs: the timed verify steps
    (``WorkerInfo.verify_costs``)."""
    best, best_value, gain, term = 0, 1.0, 1.0, 1.0
    for k in range(1, most + 1):
        term *= acceptance
        gain += term
        value = gain / (1.0 + weight * verify_extra(k, costs) + k * draft_cost)
        if value > best_value:
            best, best_value = k, value
    return best


def kept_tokens(draft: list[int], sampled: list[int]) -> int:
    """How many drafted tokens a verified row keeps: those before the first its sampler disagreed with (sampled[j]:
    the token sampled where draft[j] stands)."""
    kept = 0
    while kept < len(draft) and sampled[kept] == draft[kept]:
        kept += 1
    return kept


def may_speculate(seq: Sequence) -> bool:
    """Whether seq samples one token a row (a beam search's rows rank continuations across its beams)."""
    return seq.request.beams is None


class DraftCheck(Protocol):
    """What a guided sample's grammar allows (the core's ``Guides``)."""

    def valid_draft(self, seq: Sequence, draft: list[int]) -> list[int]:
        """The longest start of draft that seq's grammar takes from where seq is."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, lookup: bool = True, draft_cost: float | None = None,
                 verify_costs: tuple[float, ...] | None = None, catch_up: int | None = None) -> None:
        """lookup: draft from the sequence's own tokens (speculative_config given); False: only predictions.
        draft_cost: a draft model's step against the target's (``WorkerInfo.draft_cost``); None: no draft model.
        verify_costs: a step verifying k drafted tokens against a decode step (``WorkerInfo.verify_costs``); None:
        the constants. catch_up: the tokens a step may feed the draft model's KV (``WorkerInfo.draft_catch_up``);
        None: no limit."""
        self.config = config
        self.lookup = lookup
        self.draft_cost = draft_cost
        self.verify_costs = verify_costs
        # n-gram lookup also searches the outputs of recently finished requests with the same prefix-cache salt
        # (a salt isolates its users: another's answers must not speed theirs up), for the last prompt_lookup_max
        # tokens; the most recently used MAX_RECENT_SALTS salts keep theirs
        self.recent: dict[object, RecentOutputs | RecentSuffixes] | None = {} if lookup else None
        self.suffix = config.method == "suffix"
        if self.suffix and not config.suffix_decoding_max_cached_requests:
            self.recent = None
        self.max_batch = config.disable_by_batch_size or DEFAULT_MAX_BATCH
        self.states: dict[int, _SeqState] = {}  # sequence id -> its lookup index and acceptance
        self.counts = SpeculationCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.catch_up = catch_up
        self.room = 0  # this step's catch-up budget left
        self.orders: dict[int, int] = {}  # sequence id -> tokens to feed the draft model's KV this step
        self.placeholders: dict[int, int] = {}  # sequence id -> its ``fed`` before this step's draft-model draft

    def propose(self, running: list[Sequence], check: DraftCheck | None = None) -> None:
        """Set ``draft_token_ids`` of every running sequence: a draft for those that decode and may speculate,
        nothing for the others; a guided sequence's cut to what its grammar takes (check)."""
        decoding = []
        self.orders, self.placeholders = {}, {}
        self.room = self.catch_up if self.catch_up is not None else 1 << 62
        for seq in running:
            seq.draft_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens == 1:
                decoding.append(seq)
        rows = len(decoding)
        if rows == 0 or rows > self.max_batch:
            return
        weight = draft_weight(rows)
        for seq in decoding:
            # a draft follows an output token: the last prompt token's row may still owe prompt logprobs
            if seq.num_output_tokens == 0 or not (self.lookup or seq.request.record.prediction_token_ids) \
                    or not may_speculate(seq):
                continue
            guided = check if seq.request.record.grammar is not None else None
            if guided is None and seq.request.record.grammar is not None:
                continue  # nothing to say what its grammar takes
            # the draft and the token sampled after it must fit max_tokens (and max_model_len)
            seq.draft_token_ids = self._draft(seq, self._state(seq), weight, seq.max_num_tokens - seq.num_tokens - 1,
                                              guided)

    def _draft(self, seq: Sequence, st: _SeqState, weight: float, room: int, guided: DraftCheck | None) -> list[int]:
        """A draft free to make (the prediction's, else the lookup's) where its estimate pays for one and it finds
        tokens (a guided sequence's: those its grammar takes); else, with a draft model and no grammar,
        placeholders for as many tokens as its estimate pays for; else none."""
        most = self.config.num_speculative_tokens
        k = st.lookup.k(weight, most, room, 0.0, self.verify_costs)
        if k <= 0:
            st.lookup.idle()
        elif draft := self._free(seq, st, k):
            if guided is not None:
                draft = guided.valid_draft(seq, draft)
            if draft:
                st.pending = st.lookup
                return draft
        if st.model is None or guided is not None:
            return []
        k = st.model.k(weight, most, room, self.draft_cost, self.verify_costs)
        if k <= 0:
            st.model.idle()
            return []
        # the tokens before its last the draft's KV was never fed: 0 or 1 for a sequence that drafted last step
        # (the token sampled after a kept draft), a new one's whole prompt
        lacking = seq.num_tokens - 1 - st.fed
        if lacking > self.room + 1:  # it drafts once it has caught up: a share of them now, the rest later
            if self.room > 0:
                self.orders[seq.seq_id] = self.room
                st.fed += self.room
                self.room = 0
            return []
        self.room -= max(lacking - 1, 0)
        self.placeholders[seq.seq_id] = st.fed
        st.fed = seq.num_tokens  # the draft feeds all it lacks and the last token (``record`` adds what it kept)
        st.pending = st.model
        return [DRAFT_PLACEHOLDER] * k

    def catch_up_orders(self, scheduled: list[Sequence], preempted: list[Sequence]) -> dict[int, int]:
        """This step's catch-up orders for the sequences it runs (the others' are taken back, as are the draft
        model's drafts the scheduler dropped); a preempted sequence's draft KV went with its blocks (the workers
        drop it), so it starts again from nothing."""
        orders, placeholders, self.orders, self.placeholders = self.orders, self.placeholders, {}, {}
        running = {seq.seq_id: seq for seq in scheduled}
        for i, m in orders.items():
            if i not in running and (st := self.states.get(i)) is not None:
                st.fed -= m
        for i, fed in placeholders.items():
            seq = running.get(i)
            if (seq is None or not seq.draft_token_ids) and (st := self.states.get(i)) is not None:
                st.fed = fed
        for seq in preempted:
            if (st := self.states.get(seq.seq_id)) is not None:
                st.fed = 0
        return {i: m for i, m in orders.items() if i in running}

    def _free(self, seq: Sequence, st: _SeqState, k: int) -> list[int]:
        """Up to k tokens from the prediction, else from the sequence's own tokens, else from recent outputs."""
        draft = _from_prediction(seq, st, k) if st.prediction is not None else []
        if draft or not self.lookup:
            return draft
        st.index.extend(seq.token_ids[len(st.index.tokens):])
        recent = self.recent.get(seq.request.record.cache_salt) if self.recent is not None else None
        if isinstance(st.index, SuffixIndex):  # the better of the sequence's own draft and the recent outputs'
            own = st.index.speculate(seq.token_ids, k)
            other = recent.speculate(seq.token_ids, k) if recent is not None else own
            if own.score >= other.score:
                return own.tokens
            st.index.last = None  # the own draft was not sent: no resync from it
            return other.tokens
        draft = st.index.propose(seq.token_ids, k)
        return draft or (recent.propose(seq.token_ids, k) if recent is not None else [])

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """seq verified a draft of ``drafted`` tokens and kept the first ``accepted``."""
        st = self.states.get(seq.seq_id)
        if st is not None:
            if st.pending is not None and st.pending is st.model:  # the drafter fed its drafted tokens but the last
                st.fed += min(accepted, drafted - 1)
            (st.pending or st.lookup).record(drafted, accepted)
        c = self.counts
        c.drafts += 1
        c.drafted_tokens += drafted
        c.accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_position[i] += 1

    def finished(self, seq: Sequence) -> None:
        """seq's sample ended: its output joins the recent outputs that n-gram lookup searches."""
        if self.recent is None or not seq.num_output_tokens:
            return
        salt = seq.request.record.cache_salt
        recent = self.recent.pop(salt, None) or self._recent_outputs()
        self.recent[salt] = recent  # the most recently used last
        if len(self.recent) > MAX_RECENT_SALTS:
            del self.recent[next(iter(self.recent))]
        recent.add(seq.token_ids[seq.num_prompt_tokens:])

    def forget(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.states.pop(i, None)

    def _recent_outputs(self) -> RecentOutputs | RecentSuffixes:
        cfg = self.config
        if self.suffix:
            return RecentSuffixes(cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_tree_depth,
                                  cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob)
        return RecentOutputs(cfg.prompt_lookup_max)

    def _state(self, seq: Sequence) -> _SeqState:
        st = self.states.get(seq.seq_id)
        if st is None:
            cfg = self.config
            index = SuffixIndex(cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor,
                                cfg.suffix_decoding_min_token_prob, resync=True) if self.suffix \
                else NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            st = self.states[seq.seq_id] = _SeqState(index)
            predicted = seq.request.record.prediction_token_ids
            if predicted:
                st.prediction = NgramIndex(1, cfg.prompt_lookup_max)
                st.prediction.extend(predicted)
            if self.draft_cost is not None:
                st.model = _Estimate(_PRIOR_ACCEPT_DRAFT_MODEL)
        return st


def _from_prediction(seq: Sequence, st: _SeqState, k: int) -> list[int]:
    """The prediction's next k tokens while the output copies its start (checked over the new tokens only), else
    those after the output's longest suffix found in it."""
    predicted, out = st.prediction.tokens, seq.num_output_tokens
    if st.copied >= 0:
        tokens, start = seq.token_ids, seq.num_prompt_tokens
        while st.copied < out and st.copied < len(predicted) and predicted[st.copied] == tokens[start + st.copied]:
            st.copied += 1
        if st.copied == out:
            return predicted[out:out + k]
        st.copied = -1
    return st.prediction.propose(seq.token_ids, k)
