"""The engine core over the scripted executor as a hypothesis state machine: random sequences of add (prompt
lengths, max_tokens, n, beam search, shared prefixes, LoRA adapters over few slots), abort (a live, an ended or an
unknown id), a stop string found by the front end, and steps, over a pool small enough that the scheduler preempts
and gives sequences up by itself. After every rule the core's books must agree with each other: each block's
reference count is the number of live block tables that hold it, the free list is exactly the unreferenced blocks,
the prefix cache's maps are each other's inverse and hold the tokens of the sequences that use them; every request
ends exactly once, nothing comes for it after its end or its abort, and when all have ended nothing is held."""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, settings, target
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from unit.fakes import EOS, add, make_core, request

from ember.config import SpeculativeConfig
from ember.errors import DoesNotFitError
from ember.frontend.processor import InputProcessor
from ember.protocol import EngineOutput, FinishReason, RequestStatus, SamplingRow

BLOCK = 4
MAX_MODEL_LEN = 64
SHARED = [(7 * j) % 90 + 10 for j in range(48)]  # the prefix some prompts start with


def script(row: SamplingRow) -> int:
    """Short cycles (n-gram drafts find them) and an EOS now and then; a function of the sample's seed, not of its
    handle (a process-wide counter), so that hypothesis replays a case exactly (a beam search has no seed)."""
    seed = row.seed or 0
    if seed % 5 == 3 and row.num_output_tokens == 2:
        return EOS
    return 100 + (seed % 3) * 10 + row.num_output_tokens % 4


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = None
        self.count = 0
        self.expected: dict[str, int] = {}  # live core request id -> samples it reports
        self.max_tokens: dict[str, int] = {}
        self.finishes: dict[str, Counter] = {}  # core request id -> sample index -> finish statuses seen
        self.tokens: dict[str, Counter] = {}  # core request id -> sample index -> tokens seen
        self.ended: set[str] = set()
        self.requests: dict[str, object] = {}  # every core request ever added, ended ones too
        self.errors = 0  # requests ended because their adapter could not be read

    @initialize(num_blocks=st.integers(3, 20), max_loras=st.sampled_from([0, 1, 2]), caching=st.booleans(),
                chunked=st.booleans(), budget=st.sampled_from([16, 64]), max_num_seqs=st.integers(1, 6),
                policy=st.sampled_from(["max_utilization", "max_utilization", "guaranteed_no_evict"]),
                speculative=st.booleans(), host=st.sampled_from([0, 0, 6]))
    def start(self, num_blocks, max_loras, caching, chunked, budget, max_num_seqs, policy, speculative, host) -> None:
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2) \
            if speculative else None
        self.core = make_core(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget if chunked else 64,
                              chunked_prefill=chunked, prefix_caching=caching, policy=policy, script=script,
                              speculative=spec, max_loras=max_loras, num_host_blocks=host)
        # the front end's check of what may be queued at all (the pool can never hold it: refused before queueing)
        self.fits = SimpleNamespace(info=self.core.model_info, window=None)

    # ----- rules -----

    @rule(plen=st.integers(1, 48), shared=st.sampled_from([0, 0, 4, 8, 16, 47]), max_tokens=st.integers(1, 16),
          n=st.sampled_from([1, 1, 1, 2, 3]), beam=st.sampled_from([0, 0, 0, 0, 2]), lora_id=st.integers(0, 3),
          ignore_eos=st.booleans())
    def add_request(self, plen, shared, max_tokens, n, beam, lora_id, ignore_eos) -> None:
        rid = f"r{self.count}"
        self.count += 1
        shared = min(shared, plen)
        prompt = SHARED[:shared] + [(self.count * 13 + j) % 900 + 3 for j in range(plen - shared)]
        lora_id = lora_id if self.core.loras is not None else 0
        params = dict(max_tokens=max_tokens, ignore_eos=ignore_eos)
        if beam:
            params.update(beam_width=beam, n=min(n, beam))
        else:
            params.update(n=n, temperature=1.0 if n > 1 else 0.0, seed=self.count * 7)
        record = request(rid, prompt, MAX_MODEL_LEN, lora_id=lora_id, **params)
        if max(record.params.n, record.params.beam_width) > self.core.sched_config.max_num_seqs:
            return  # refused by the front end (InputProcessor.process): it could never be admitted
        try:
            InputProcessor._check_fits(self.fits, len(prompt), record.params, record.max_num_tokens)
        except DoesNotFitError:
            return
        for cid in add(self.core, record):
            self.expected[cid] = record.params.n if beam else 1
            self.max_tokens[cid] = max_tokens
            self.finishes[cid], self.tokens[cid] = Counter(), Counter()
            self.requests[cid] = self.core.requests[cid]

    @rule(which=st.sampled_from(["live", "ended", "unknown"]), pick=st.integers(0, 1000))
    def abort(self, which, pick) -> None:
        ids = sorted(self.expected) if which == "live" else sorted(self.ended) if which == "ended" else ["nobody"]
        if not ids:
            return
        cid = ids[pick % len(ids)]
        out = self.core.abort(cid)
        if which != "live":
            assert out is None, f"abort of {which} {cid} answered {out}"
            return
        assert out is not None and out.request_id == cid
        unfinished = {i for i in range(self.expected[cid]) if not self.finishes[cid][i]}
        self.take([out])
        assert {s.index for s in out.samples if s.finish_reason is FinishReason.ABORT} >= unfinished - {None}
        assert cid in self.ended, f"{cid} still live after its abort"

    @rule(pick=st.integers(0, 1000))
    def stop_string(self, pick) -> None:
        """The front end found a stop string in a sample's text: the sample ends there (its final status is the
        front end's), and the core sends nothing more for it."""
        ids = sorted(c for c, n in self.expected.items() if n == 1 and self.requests[c].params.beam_width == 1)
        if not ids:
            return
        cid = ids[pick % len(ids)]
        if not self.requests[cid].seqs[0].num_output_tokens:
            return  # a stop string is found in generated text only
        self.core.stop_sample(cid, 0)
        self.finishes[cid][0] += 1
        self.settle()

    @rule(lora_id=st.integers(1, 3), lost=st.booleans())
    def lose_adapter(self, lora_id, lost) -> None:
        """An adapter's folder removed after its requests were accepted (or put back): the next load into a slot
        fails, and only the requests needing that adapter end, with ERROR."""
        path = f"/adapters/{lora_id}"
        unreadable = self.core.executor.unreadable
        unreadable.add(path) if lost else unreadable.discard(path)

    @rule(k=st.integers(1, 6))
    def step(self, k) -> None:
        for _ in range(k):  # several steps per rule: sequences grow into each other and the pool runs out
            if self.core.has_work():
                self.take(self.core.step())

    # ----- bookkeeping of what came out -----

    def take(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            cid = out.request_id
            assert cid not in self.ended, f"output for {cid} after it ended: {out}"
            assert cid in self.expected, f"output for a request never added: {out}"
            if out.error is not None:  # its adapter could not be read: every sample ends here, no tokens
                lora = self.requests[cid].record.lora
                assert lora is not None and lora.lora_path in self.core.executor.unreadable, out
                assert all(s.finish_reason is FinishReason.ERROR and not s.new_token_ids for s in out.samples), out
                self.errors += 1
            for s in out.samples:
                self.tokens[cid][s.index] += len(s.new_token_ids)
                assert self.tokens[cid][s.index] <= self.max_tokens[cid], (cid, s.index, self.tokens[cid])
                if s.finish_reason is not None:
                    self.finishes[cid][s.index] += 1
                    assert self.finishes[cid][s.index] == 1, f"{cid} sample {s.index} ended twice"
        self.settle()

    def settle(self) -> None:
        """A request the core no longer holds has ended: each of its samples with exactly one final status."""
        for cid in [c for c in self.expected if c not in self.core.requests]:
            n = self.expected.pop(cid)
            assert all(self.finishes[cid][i] == 1 for i in range(n)), (cid, self.finishes[cid])
            self.ended.add(cid)

    # ----- invariants -----

    def live_sequences(self) -> list:
        sched, seen, seqs = self.core.scheduler, set(), []
        for seq in [*sched.running, *sched.waiting, *(s for r in self.core.requests.values() for s in r.seqs)]:
            if id(seq) not in seen:
                seen.add(id(seq))
                seqs.append(seq)
        return seqs

    @invariant()
    def queues_agree_with_statuses(self) -> None:
        if self.core is None:
            return
        sched = self.core.scheduler
        running, waiting = {id(s) for s in sched.running}, {id(s) for s in sched.waiting}
        assert not running & waiting
        assert all(s.status is RequestStatus.RUNNING for s in sched.running)
        assert all(s.status is RequestStatus.WAITING for s in sched.waiting)
        for seq in [*sched.running, *sched.waiting]:
            assert seq.request.request_id in self.core.requests, f"{seq} queued for an ended request"
        assert len(sched.running) <= sched.max_num_seqs
        assert set(self.core.requests) == set(self.expected), "the core and the outputs disagree on who is live"

    @invariant()
    def blocks_are_counted_once(self) -> None:
        if self.core is None:
            return
        bm = self.core.block_manager
        refs = Counter(b for seq in self.live_sequences() for b in seq.block_table)
        for seq in self.live_sequences():
            if seq.is_finished:
                assert not seq.block_table, f"finished {seq} still holds blocks {seq.block_table}"
        for cid in self.ended:
            assert all(not s.block_table for s in self.requests[cid].seqs), f"ended {cid} holds blocks"
        assert bm.ref_counts == [refs.get(b, 0) for b in range(bm.num_blocks)], "reference counts drifted"
        assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if not refs.get(b)}
        assert bm.num_free + sum(1 for r in bm.ref_counts if r) == bm.num_blocks

    @invariant()
    def prefix_cache_is_consistent(self) -> None:
        if self.core is None:
            return
        bm = self.core.block_manager
        assert {b: h for h, b in bm.cached.items()} == bm.block_hash
        assert set(bm.block_keys) == set(bm.block_hash)
        assert all(len(key[1]) == BLOCK for key in bm.block_keys.values())
        assert all(hash(key) == bm.block_hash[b] for b, key in bm.block_keys.items())
        host = bm.host
        if host is not None:  # exclusive tiers: a hash lives on the device or on the host, never both
            assert {b: h for h, b in host.cached.items()} == host.block_hash
            assert set(host.block_keys) == set(host.block_hash) and set(host.free) == set(range(host.num_blocks))
            assert not set(host.cached) & set(bm.cached)
        for seq in self.live_sequences():
            for i in range(seq.num_hashed_blocks):
                block = seq.block_table[i]
                tokens = tuple(seq.token_ids[i * BLOCK:(i + 1) * BLOCK])
                key = bm.block_keys.get(block)
                assert key is None or key[1] == tokens, f"{seq} block {i} holds other tokens"

    @invariant()
    def running_adapters_are_resident(self) -> None:
        loras = self.core.loras if self.core is not None else None
        if loras is None:
            return
        resident = [r for r in loras.resident if r is not None]
        assert len(resident) == len(set(resident))
        for seq in self.core.scheduler.running:
            lora_id = seq.request.lora_id
            assert not lora_id or lora_id in resident, f"{seq} runs with adapter {lora_id}, not resident"

    @invariant()
    def the_worker_holds_only_live_samples(self) -> None:
        if self.core is None:
            return
        live = {s.seq_id for s in self.live_sequences() if not s.is_finished}
        assert self.core.executor.live <= live | set(self.core.decoding.released)

    def teardown(self) -> None:
        """Run to the end: every request ends, once, and nothing stays held anywhere."""
        core = self.core
        if core is None:
            return
        if currently_in_test_context():  # not in a replayed case
            target(float(core.scheduler.num_preemptions), label="preemptions")  # steer towards KV pressure
            event(f"preempted: {core.scheduler.num_preemptions > 0}")  # shown by --hypothesis-show-statistics
            event(f"swapped to the host tier: {core.block_manager.swapped_out > 0}")
            event(f"a request ended with ERROR: {self.errors > 0}")
        for _ in range(1000):
            if not core.has_work():
                break
            self.take(core.step())
        assert not core.has_work(), "the core still has work after 1000 steps"
        assert not self.expected, f"requests that never ended: {sorted(self.expected)}"
        assert not core.requests and core.block_manager.num_used == 0
        assert not core.scheduler.running and not core.scheduler.waiting
        assert not core.executor.live
        for cid, counts in self.finishes.items():
            assert all(v == 1 for v in counts.values()), (cid, counts)


# found by the machine: beam searches preempting each other's answered beams in the normal (not _unblock) path,
# under chunked prefill, one adapter slot and speculative decoding; (plen, shared, max_tokens, n, beam, lora_id,
# ignore_eos) of each request, added before the first step
TURNS = [
    (17, 0, 1, 3, 0, 2, False),
    (5, 4, 5, 2, 2, 0, True),
    (42, 47, 6, 3, 2, 3, False),
    (25, 0, 4, 1, 0, 2, True),
    (30, 0, 14, 2, 0, 2, False),
    (8, 0, 3, 1, 0, 2, False),
    (7, 4, 8, 2, 0, 3, True),
    (15, 47, 10, 3, 2, 0, False),
    (37, 8, 11, 3, 2, 0, False),
    (40, 0, 5, 1, 2, 3, True),
    (11, 8, 14, 2, 0, 1, False),
    (1, 0, 12, 1, 0, 1, False),
    (31, 0, 6, 1, 0, 0, False),
    (31, 16, 14, 3, 0, 1, False),
    (27, 4, 14, 1, 0, 2, False),
    (45, 47, 16, 1, 0, 3, True),
    (14, 47, 2, 1, 2, 1, False),
    (30, 47, 11, 2, 0, 1, False),
    (42, 8, 2, 1, 0, 2, False),
    (23, 0, 5, 1, 0, 1, True),
    (37, 0, 12, 3, 0, 0, True),
    (44, 47, 11, 1, 0, 3, False),
    (4, 0, 7, 2, 0, 2, True),
    (33, 16, 9, 1, 2, 1, True),
    (48, 8, 5, 3, 2, 1, False),
    (19, 8, 1, 1, 0, 0, False),
    (21, 0, 16, 2, 2, 3, True),
    (14, 16, 6, 3, 2, 2, False),
    (43, 47, 13, 1, 0, 0, False),
    (22, 8, 11, 1, 0, 0, False),
    (31, 4, 9, 3, 0, 1, False),
    (27, 47, 1, 1, 0, 2, False),
    (2, 47, 12, 3, 0, 1, True),
    (30, 8, 16, 3, 0, 2, False),
    (14, 0, 10, 3, 0, 0, False),
    (28, 0, 13, 1, 0, 2, False),
    (45, 8, 3, 1, 2, 0, False),
    (41, 0, 5, 1, 0, 2, True),
    (37, 47, 10, 1, 2, 2, True),
]


def test_beam_searches_preempted_by_a_chunked_prefill_do_not_take_turns_for_ever():
    """Replayed case: a running search's prefill preempted the other search's answered beam to the front of the
    queue, ahead of its own waiting beam, so each search in turn lost its answered beam. The victim now queues
    behind the waiting beams of the search it gave way to (``Scheduler._siblings_first``)."""
    machine = CoreMachine()
    machine.start(max_loras=1, num_blocks=20, policy='max_utilization', budget=16, host=6, chunked=True,
                  speculative=True, caching=False, max_num_seqs=5)
    for plen, shared, max_tokens, n, beam, lora_id, ignore_eos in TURNS:
        machine.add_request(plen=plen, shared=shared, max_tokens=max_tokens, n=n, beam=beam, lora_id=lora_id,
                            ignore_eos=ignore_eos)
    machine.teardown()  # every request ends, once, and the pool is whole


FAST = settings(max_examples=100, stateful_step_count=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# the slow tier's share of CI time: 500 cases (~15 s); EMBER_STATE_MACHINE_CASES for a longer search
SLOW = settings(max_examples=int(os.environ.get("EMBER_STATE_MACHINE_CASES", 500)), stateful_step_count=80,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = FAST


class TestCoreMachineLong(CoreMachine.TestCase):
    settings = SLOW
    pytestmark = pytest.mark.slow
