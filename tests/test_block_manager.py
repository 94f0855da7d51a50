"""Block manager and scheduler invariants under random arrivals, finishes, aborts and tiny pools."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.block_manager import BlockManager
from ember.core.scheduler import Scheduler
from ember.core.sequence import Sequence, SequenceStatus


def _seq(prompt_len: int, n: int = 1) -> Sequence:
    req = SimpleNamespace(prompt_token_ids=[1] * prompt_len, request_id="r", num_cached_tokens=None,
                          wants_prompt_logprobs=False)
    return Sequence(req, 0, [1] * prompt_len, None, None, pending_fork=n - 1)


def _check(bm: BlockManager, seqs: list[Sequence]) -> None:
    assert all(r >= 0 for r in bm.ref_counts)
    refs = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts  # every reference is held by a live sequence: nothing leaked
    assert len(set(bm.free_blocks)) == bm.num_free  # nothing freed twice
    assert all(bm.ref_counts[b] == 0 for b in bm.free_blocks)
    assert bm.num_free + sum(1 for r in bm.ref_counts if r > 0) == bm.num_blocks
    assert all(bm.block_hash[b] == h for h, b in bm.cached.items())  # the prefix cache is consistent
    assert set(bm.block_hash) == set(bm.cached.values()) == set(bm.block_tokens)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]), step_budget=st.integers(1, 80),
       chunked=st.booleans(),
       events=st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 60),
                               st.integers(1, 3)), min_size=1, max_size=60))
def test_scheduler_never_leaks_or_hangs(num_blocks, block_size, step_budget, chunked, events):
    bm = BlockManager(num_blocks, block_size)
    max_len = num_blocks * block_size  # any single sequence fits the pool
    budget_tokens = step_budget if chunked else max(max_len, 64)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget_tokens, chunked_prefill=chunked)
    live: list[Sequence] = []
    budget: dict[int, int] = {}

    def step():
        batch = sched.schedule()
        assert sum(batch.num_tokens) <= budget_tokens
        for seq, n in zip(batch.seqs, batch.num_tokens):  # every scheduled token has a slot
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(2)
                if seq.num_tokens >= budget[seq.seq_id]:
                    seq.status = SequenceStatus.FINISHED
                    sched.finish(seq)
                    live.remove(seq)
        _check(bm, live)
        return batch

    for kind, size, extra in events:
        if kind == "add":
            seq = _seq(min(size, max_len - 1))
            seq.token_ids[-1] = extra  # prompts share prefixes of ones: the prefix cache is exercised
            budget[seq.seq_id] = min(seq.num_tokens + extra * 5, max_len)
            live.append(seq)
            sched.add(seq)
        elif kind == "step":
            step()
        elif live:
            victim = live[size % len(live)]
            sched.finish(victim)
            victim.status = SequenceStatus.FINISHED
            live.remove(victim)
            _check(bm, live)
    for _ in range(10_000):  # every request ends
        if not live:
            break
        step()
    assert not live and not sched.has_work()
    assert bm.num_free == num_blocks


def test_share_counts_references():
    bm = BlockManager(8, 4)
    parent, child = _seq(10), _seq(10)
    bm.allocate(parent, 10)
    bm.share(parent, child, 8)
    assert bm.ref_counts[parent.block_table[0]] == 2 and bm.num_free == 5
    bm.free(parent)
    assert bm.num_free == 6  # the shared blocks stay for the child
    bm.free(child)
    assert bm.num_free == 8

