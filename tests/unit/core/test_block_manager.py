"""Block manager and scheduler invariants under random arrivals, finishes, aborts and tiny pools, under both
policies and with a host tier: the KV a sequence is given is the KV its tokens produced (simulated block contents
follow every queued copy), nothing leaks, nothing is freed twice, every request ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.block_manager import BlockManager
from ember.core.request import Sequence
from ember.core.scheduler import Scheduler
from ember.protocol import BlockCopy, CopyKind, FinishReason, MultiModalInput, Placeholder, RequestStatus


def _seq(prompt: list[int], max_num_tokens: int | None = None, images: tuple = ()) -> Sequence:
    req = SimpleNamespace(prompt_token_ids=list(prompt), request_id="r", num_cached_tokens=None,
                          num_host_cached_tokens=0, wants_prompt_logprobs=False, pools=False,
                          record=SimpleNamespace(mm_inputs=images))
    return Sequence(req, 0, list(prompt), max_num_tokens=max_num_tokens)


def _check(bm: BlockManager, seqs: list[Sequence]) -> None:
    assert all(r >= 0 for r in bm.ref_counts)  # reference counts never negative
    refs = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            refs[b] += 1
    assert refs == bm.ref_counts  # every reference is held by a live sequence: nothing leaked
    assert len(set(bm.free_blocks)) == bm.num_free  # nothing freed twice
    assert all(bm.ref_counts[b] == 0 for b in bm.free_blocks)
    assert bm.num_free + sum(1 for r in bm.ref_counts if r > 0) == bm.num_blocks  # free + used == total
    assert all(bm.block_hash[b] == h for h, b in bm.cached.items())  # the prefix cache is consistent
    assert set(bm.block_hash) == set(bm.cached.values()) == set(bm.block_keys)
    if bm.host is not None:
        assert all(bm.host.block_hash[b] == h for h, b in bm.host.cached.items())
        assert len(bm.host.free) == bm.host.num_blocks


DOCS = {i: [(i * 7 + j * (j % i + 1)) % 5 for j in range(64)] for i in (1, 2, 3)}


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 4, 16]), step_budget=st.integers(1, 80),
       chunked=st.booleans(), policy=st.sampled_from(["max_utilization", "guaranteed_no_evict"]),
       host_blocks=st.sampled_from([0, 0, 3, 12]), prefill_cap=st.sampled_from([None, None, 1, 2]),
       events=st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 60),
                               st.integers(1, 3)), min_size=1, max_size=60))
def test_scheduler_never_leaks_or_hangs(num_blocks, block_size, step_budget, chunked, policy, host_blocks,
                                        prefill_cap, events):
    bm = BlockManager(num_blocks, block_size, num_host_blocks=host_blocks)
    max_len = num_blocks * block_size  # any single sequence fits the pool
    budget_tokens = step_budget if chunked else max(max_len, 64)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget_tokens, chunked_prefill=chunked,
                      policy=policy, max_num_prefill_seqs=prefill_cap)
    device = [[None] * block_size for _ in range(num_blocks)]  # what each slot holds: (token, position) pairs
    host = [[None] * block_size for _ in range(host_blocks)]
    live: list[Sequence] = []

    def step():
        batch = sched.schedule()
        assert sum(batch.num_tokens) <= budget_tokens
        prefills = sum(1 for seq in batch.seqs if seq.num_tokens - seq.num_computed_tokens > 1)
        assert prefill_cap is None or prefills <= prefill_cap
        for copy in batch.copies:  # the model runner's job, in order
            src, dst = copy.src, copy.dst
            if copy.kind is CopyKind.SWAP_OUT:
                host[dst] = list(device[src])
            else:
                device[dst] = list(host[src])
        # the model runner writes each row's K/V before that row attends, rows in batch order (the strictest
        # order a step may run them in: pipeline micro-batches); a sequence's context may be blocks an earlier
        # row of the same step writes (a prefix shared within the step)
        for seq, n in zip(batch.seqs, batch.num_tokens):  # every scheduled token has a slot ...
            assert seq.status is RequestStatus.RUNNING and n >= 1
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                device[seq.block_table[p // block_size]][p % block_size] = hash(tuple(seq.token_ids[:p + 1]))
            for p in range(seq.num_computed_tokens):  # ... and the cached context is this sequence's own KV
                prefix = tuple(seq.token_ids[:p + 1])
                assert device[seq.block_table[p // block_size]][p % block_size] == hash(prefix)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            bm.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7 + seq.num_tokens % 3)
                if seq.num_tokens >= seq.max_num_tokens:
                    seq.finish(FinishReason.STOP)
                    sched.finish(seq)
                    live.remove(seq)
        for seq in batch.interrupted:
            live.remove(seq)
        _check(bm, live)
        return batch

    for kind, size, extra in events:
        if kind == "add":
            prompt = DOCS[extra][:min(size, max_len - 1)]  # three documents: prefixes are shared and come back
            seq = _seq(prompt, max_num_tokens=min(len(prompt) + extra * 5, max_len))
            live.append(seq)
            sched.add(seq)
        elif kind == "step":
            step()
        elif live:
            victim = live[size % len(live)]
            sched.finish(victim)
            victim.finish(FinishReason.ABORT)
            live.remove(victim)
            _check(bm, live)
    for _ in range(10_000):  # every request ends
        if not live:
            break
        step()
    assert not live and not sched.has_work()
    assert bm.num_free == num_blocks
    assert sched.num_interrupted == 0  # every sequence fits the pool alone: none is given up
    if policy == "guaranteed_no_evict":
        assert sched.num_preemptions == 0


def test_no_evict_admits_only_what_it_can_reserve():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, policy="guaranteed_no_evict")
    a, b = _seq([1] * 8, max_num_tokens=24), _seq([2] * 8, max_num_tokens=24)  # 6 blocks each at the end
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a]  # b's 6 blocks cannot be reserved next to a's
    greedy = Scheduler(BlockManager(10, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a2, b2 = _seq([1] * 8, max_num_tokens=24), _seq([2] * 8, max_num_tokens=24)
    greedy.add(a2)
    greedy.add(b2)
    assert greedy.schedule().seqs == [a2, b2]  # max_utilization admits both and preempts later


def test_sequence_too_big_for_the_pool_is_interrupted():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = _seq([1] * 14, max_num_tokens=40)
    sched.add(seq)
    for _ in range(10):
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed_tokens += n
            s.token_ids.append(3)
        if batch.interrupted:
            break
    assert batch.interrupted == [seq] and seq.finish_reason == "interrupted"
    assert seq.num_tokens == 17 and not sched.has_work()  # it keeps the tokens it generated
    assert bm.num_free == 4 and sched.num_interrupted == 1


def test_equal_tokens_with_another_image_hit_only_the_blocks_before_it():
    """A block's key holds the hashes of the images its placeholders cover (and the chain carries them on)."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)

    def image(h: str) -> tuple:
        return (MultiModalInput(Placeholder(h, 6, 5), {}),)  # positions 6..10: blocks 1 and 2

    a = _seq([7] * 17, images=image("a"))
    bm.allocate(a, 17)
    a.num_computed_tokens = 17
    bm.commit(a)
    assert bm.lookup(_seq([7] * 17, images=image("b"))).num_blocks == 1  # block 0 only
    assert bm.lookup(_seq([7] * 17, images=image("a"))).num_blocks == 4  # all full blocks
    assert bm.lookup(_seq([7] * 17)).num_blocks == 1  # the same tokens as text


def test_host_tier_round_trip():
    bm = BlockManager(4, 4, num_host_blocks=4)
    a = _seq([5] * 9)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)  # two full blocks cached
    bm.free(a)
    b = _seq([6] * 16)
    bm.allocate(b, 16)  # takes all four blocks: a's two cached blocks move to the host tier
    assert [c.kind for c in bm.take_copies()] == [CopyKind.SWAP_OUT] * 2 and bm.swapped_out == 2
    b.num_computed_tokens = 16
    bm.commit(b)
    bm.free(b)
    again = _seq([5] * 9)
    hit = bm.lookup(again)
    assert [tier for tier, _, _ in hit.blocks] == ["host", "host"]
    assert bm.take_cached(again, hit) == (0, 8)
    copies = bm.take_copies()
    # b's blocks were cached too: the device blocks the copy-back reuses push them out first, in order
    assert [c.kind for c in copies] == [CopyKind.SWAP_OUT, CopyKind.SWAP_IN] * 2 and bm.swapped_in == 2
    assert len(bm.host.cached) == 2  # the scheduler sets num_computed_tokens from what take_cached returned


def test_a_block_computed_again_on_the_device_leaves_the_host_tier():
    """Found by the core state machine: a block that went to the host tier and was computed again on the device
    (a prompt's last full block, which lookup never serves) was cached in both tiers. The host copy is dropped."""
    bm = BlockManager(4, 4, num_host_blocks=4)
    a = _seq([5] * 9)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)
    b = _seq([6] * 16)
    bm.allocate(b, 16)  # a's two cached blocks move to the host tier
    bm.free(b)
    assert len(bm.host.cached) == 2
    c = _seq([5] * 4)  # a's first block again, as the whole prompt: computed, not looked up
    assert bm.lookup(c).num_blocks == 0
    bm.allocate(c, 4)
    c.num_computed_tokens = 4
    bm.commit(c)
    assert len(bm.host.cached) == 1 and not set(bm.host.cached) & set(bm.cached)
    _check(bm, [c])


def test_share_counts_references():
    bm = BlockManager(8, 4)
    parent, child = _seq([1] * 10), _seq([1] * 10)
    bm.allocate(parent, 10)
    bm.share(parent, child, 2)
    assert bm.ref_counts[parent.block_table[0]] == 2 and bm.num_free == 5
    bm.free(parent)
    assert bm.num_free == 6  # the shared blocks stay for the child
    bm.free(child)
    assert bm.num_free == 8


def test_append_copy_queues_the_copy_and_needs_a_free_block():
    bm = BlockManager(3, 4)
    parent, child, other = _seq([1] * 6), _seq([1] * 6), _seq([1] * 6)
    bm.allocate(parent, 6)
    bm.share(parent, child, 1)
    assert bm.append_copy(child, parent.block_table[1])
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] not in parent.block_table
    assert bm.take_copies() == [BlockCopy(CopyKind.COPY, parent.block_table[1], child.block_table[1])]
    bm.share(parent, other, 1)
    assert not bm.append_copy(other, parent.block_table[1]) and len(other.block_table) == 1  # the pool is full
    assert bm.take_copies() == []


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(BlockManager(4, 4), 4, 16, policy="fastest")


def test_a_hash_collision_with_another_key_misses():
    """A hash that ignores the salt (a stand-in for a crafted collision: Python's tuple hash over ints can be made
    to collide, and parent hashes are such ints): a block under salt "b" with the same tokens as one under "a" gets
    the same hash; the whole key is compared, so it misses instead of serving the other adapter's KV."""
    bm = BlockManager(8, 4)
    bm._key = lambda parent, tokens, extra=None: (hash((parent, tokens)), (parent, tokens, extra))  # salt unhashed
    a, b = _seq([1, 2, 3, 4, 5]), _seq([1, 2, 3, 4, 5])
    a.cache_salt, b.cache_salt = "a", "b"
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.commit(a)
    assert bm.lookup(_seq([1, 2, 3, 4, 5])).num_blocks == 0  # no salt: another key too
    assert bm.lookup(b).num_blocks == 0
    b.cache_salt = "a"
    assert bm.lookup(b).num_blocks == 1


@pytest.mark.parametrize("host_blocks", [0, 4])
def test_the_prefix_cache_ttl_holds_on_the_host_tier_too(host_blocks):
    """A block evicted to the host tier keeps the time its last user let go: once prefix_cache_ttl has passed it is
    no longer served from either tier (an hour later here), while a fresh one still is."""
    import time

    bm = BlockManager(4, 4, num_host_blocks=host_blocks, prefix_cache_ttl=10.0)
    a = _seq([5] * 9)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)
    if host_blocks:
        flood = _seq([6] * 16)
        bm.allocate(flood, 16)  # every device block: a's two go to the host tier
        bm.free(flood)
        assert len(bm.host.cached) == 2 and bm.lookup(_seq([5] * 9)).num_host == 2
    bm.expire(time.monotonic() + 5)
    assert bm.lookup(_seq([5] * 9)).num_blocks == 2  # within the TTL
    bm._next_expiry = 0.0
    bm.expire(time.monotonic() + 3600)
    assert bm.lookup(_seq([5] * 9)).num_blocks == 0 and bm.expired_blocks == 2
    _check(bm, [])
