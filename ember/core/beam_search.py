"""Beam search in the engine core (a ``strategy.DecodingStrategy``), with transformers' rules
(``GenerationMixin._beam_search``, 5.x).

A request with beam_width W starts as one sequence. Each step every live beam's row returns its K best
continuations (K = max(2, 1 + #EOS) x W: log-softmax of the logits, then the logits processors); once every live
beam has answered, the K best of (beam score + logprob) over all beams are ranked. Among them the first W that do
not end the beam (EOS, a stop token, the length limit) become the next beams; those of the first W that do end it
become finished hypotheses scored ``sum logprob / generated_length ** length_penalty``, and the W best
hypotheses are kept. The search stops when no running beam can still beat the worst kept hypothesis (transformers'
early-stopping heuristic: False, True or "never"), or when every candidate ends.

KV: a new beam is a new sequence that shares its parent's full blocks; the parent's partial last block goes to its
first child and is copied on write for the others (``BlockManager.fork``). The parents are then released. Beams of
one request advance together: a beam that ran this step waits (nothing to compute) until its siblings, delayed by
a preemption, have answered too.

The request reports once, when the search ends: its n best hypotheses, best first, as samples 0..n-1.
"""

from __future__ import annotations

from ember.core.beam_group import BeamGroup, Hypothesis
from ember.core.block_manager import BlockManager
from ember.core.request import CoreRequest, Sequence
from ember.core.scheduler import Scheduler
from ember.core.stop import Stop, check_stop
from ember.protocol import EngineOutput, FinishReason, RequestStatus, WorkerOutput


class BeamSearch:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int,
                 released: list[int]) -> None:
        self.scheduler, self.bm, self.max_model_len = scheduler, block_manager, max_model_len
        self.released = released  # the engine's list of finished handles (the worker drops their state)

    def collect(self, seq: Sequence, row: int, result: WorkerOutput, outputs: dict[str, EngineOutput]) -> None:
        """A beam's continuations; once every live beam of its request has answered, the search takes a step."""
        req = seq.request
        group = req.beams
        group.pending[seq.seq_id] = result.beams[row]
        if all(s.seq_id in group.pending for s in req.seqs if not s.is_finished):
            self._step(req, group, outputs)

    def _step(self, req: CoreRequest, group: BeamGroup, outputs: dict[str, EngineOutput]) -> None:
        p = req.params
        width, lp = p.beam_width, p.length_penalty
        beams = [s for s in req.seqs if not s.is_finished]
        ranked: list[tuple[float, int, int]] = []
        for b, seq in enumerate(beams):
            base = group.scores.get(seq.seq_id, 0.0)
            ids, lps = group.pending.pop(seq.seq_id)
            ranked.extend((base + v, b, t) for t, v in zip(ids, lps))
        ranked.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then the beam's own ranking
        ranked = ranked[:p.beam_candidates]
        length = beams[0].num_output_tokens + 1  # generated tokens once the candidate token is added
        ends = [self._ends(req, beams[b], t) for _, b, t in ranked]

        if group.improvable and not (len(group.finished) == width and p.early_stopping is True):
            for (score, b, t), end in zip(ranked[:width], ends[:width]):
                if end is not None:
                    group.finished.append(Hypothesis(score / length ** lp, score, beams[b].output_token_ids + [t],
                                                     *end))
            group.finished.sort(key=lambda h: -h.score)
            del group.finished[width:]
        chosen = [c for c, end in zip(ranked, ends) if end is None][:width]
        if len(group.finished) == width and chosen:
            never = p.early_stopping == "never" and lp > 0  # the best a beam could do: grow to the limit
            horizon = req.record.max_num_tokens - len(req.prompt_token_ids) if never else length
            best = chosen[0][0] / horizon ** lp
            group.improvable = group.improvable and best > group.finished[-1].score
        done = (not chosen or not group.improvable
                or (len(group.finished) == width and p.early_stopping is True))
        if done:
            self._finish(req, group, beams, chosen, length, outputs)
        else:
            self._advance(req, group, beams, chosen)

    def _ends(self, req: CoreRequest, beam: Sequence, token: int) -> Stop | None:
        """(finish_reason, stop_reason) when appending token ends the beam, else None (``check_stop``)."""
        return check_stop(req.params, beam.token_ids + [token], beam.num_prompt_tokens, self.max_model_len)

    def _advance(self, req: CoreRequest, group: BeamGroup, beams: list[Sequence],
                 chosen: list[tuple[float, int, int]]) -> None:
        """The chosen continuations become the running beams; the old beams are released."""
        sched = self.scheduler
        children, forked = [], set()
        for i, (score, b, token) in enumerate(chosen):
            parent = beams[b]
            child = Sequence(req, i, parent.token_ids + [token], 0, parent.max_num_tokens, parent.cache_salt)
            if parent.status is RequestStatus.RUNNING and parent.block_table:
                self._take_kv(parent, child, first=parent.seq_id not in forked)
                forked.add(parent.seq_id)
                sched.add_running(child)
            else:  # the parent was preempted after it answered: the child computes everything again
                sched.requeue(child)
            group.scores[child.seq_id] = score
            children.append(child)
        self._release(beams, group, FinishReason.STOP)
        req.seqs = children

    def _take_kv(self, parent: Sequence, child: Sequence, first: bool) -> None:
        """Give a new beam its parent's KV: the full blocks shared; the partial last block shared too for the
        parent's first child and copied on write for the others, since each beam writes its next token into that
        block. Without a free block for the copy the child keeps only the full blocks and computes the partial
        block's few tokens again."""
        bm, n = self.bm, parent.num_computed_tokens
        full = n // bm.block_size
        bm.share(parent, child, full + (1 if first and n % bm.block_size else 0))
        if not first and n % bm.block_size and not bm.append_copy(child, parent.block_table[full]):
            n = full * bm.block_size
        child.num_computed_tokens = n

    def _finish(self, req: CoreRequest, group: BeamGroup, beams: list[Sequence],
                chosen: list[tuple[float, int, int]], length: int, outputs: dict[str, EngineOutput]) -> None:
        """Report the n best hypotheses (running beams fill in if too few finished) and release every beam."""
        p = req.params
        best = list(group.finished)
        for score, b, t in chosen[:max(0, p.n - len(best))]:
            best.append(Hypothesis(score / length ** p.length_penalty, score, beams[b].output_token_ids + [t],
                                   FinishReason.LENGTH, None))
        best.sort(key=lambda h: -h.score)
        out = req.output_in(outputs)
        for i, h in enumerate(best[:p.n]):
            sample = out.sample(i)
            sample.new_token_ids = list(h.token_ids)
            sample.finish_reason, sample.stop_reason, sample.cumulative_logprob = h.finish_reason, h.stop_reason, \
                h.logprob
        self._release(beams, group, FinishReason.STOP)
        for seq in req.seqs:
            seq.extra_seats = 0

    def _release(self, beams: list[Sequence], group: BeamGroup, reason: FinishReason) -> None:
        """The beams are done with (replaced by their children, or the search ended): their blocks and state go."""
        for seq in beams:
            seq.extra_seats = 0
            seq.finish(reason)
            self.scheduler.finish(seq)
            self.released.append(seq.seq_id)
            group.scores.pop(seq.seq_id, None)
            group.pending.pop(seq.seq_id, None)

    def end(self, req: CoreRequest, reason: FinishReason, out: EngineOutput) -> None:
        """Abort or give up the whole search: every live beam released, the n samples ended with reason."""
        beams = [s for s in req.seqs if not s.is_finished]
        self._release(beams, req.beams, reason)
        for i in range(req.params.n):
            out.sample(i).finish_reason = reason
