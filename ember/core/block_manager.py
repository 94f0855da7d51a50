"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts, prefix caching,
and an optional second tier of blocks in host memory.

Blocks are shared by reference count: a sequence may point at another's blocks (``share``; beam search gives a new
beam its parent's), and with prefix caching any request whose prompt starts with the same full blocks as an earlier
one reuses their KV. The samples of an n > 1 request share their prompt that way too, also when prefix caching is
off: their sequences cache their blocks anyway (``Sequence.caches_prefix``), under a key only they use.

Prefix caching (vLLM's design): once a block is full and computed it gets a hash of its key (parent block's hash,
its token ids, extra keys such as a LoRA name); a new sequence walks its full blocks and takes every block whose hash
is cached and whose whole key is equal (a hash collision can never serve wrong KV: Python's hash of a tuple of ints
can be made to collide, and a parent hash is one of those ints). With ``prefix_cache_ttl`` a cached block unused
that long is forgotten on either tier. A block whose last reference goes
keeps its hash and waits in the free queue in least-recently-freed order; allocation takes from the front and only
then forgets the hash, so only unreferenced blocks are evicted, least recently used first.

Host tier (CUDA engines with ``cpu_cache_memory``): a cached block evicted from the device is copied to a host
block instead of being forgotten, and a later prefix hit there is copied back into a fresh device block. The tiers
are exclusive: a block lives on the device or on the host. Nothing here touches tensors: the copies are queued as
``BlockCopy`` records and the worker performs them, in order, before the step's forward pass,
which is exactly the order in which this bookkeeping reused the blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ember.core.request import Sequence
from ember.protocol import KVWindow
from ember.protocol import BlockCopy, CopyKind

BlockKey = tuple  # (parent block's hash or None, the block's token ids, its extra key): what its hash hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def request_blocks(num_prompt_tokens: int, max_num_tokens: int, num_samples: int, block_size: int,
                   window: KVWindow | None = None) -> int:
    """Blocks a request holds at most: one sample of max_num_tokens, each further one without the shared prompt
    blocks (the last prompt token is always computed again: each sample needs its logits). Under a KV window a
    sample holds at most the window and shares nothing (its ring overwrites its blocks)."""
    if window is not None:
        return num_samples * blocks_for(window.kept(max_num_tokens), block_size)
    full = blocks_for(max_num_tokens, block_size)
    return full + (num_samples - 1) * (full - (num_prompt_tokens - 1) // block_size)


@dataclass(slots=True)
class PrefixHit:
    """What lookup found for a sequence's leading full blocks, in order: (tier, block, hash) with tier "device"
    or "host"."""

    blocks: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_host(self) -> int:
        return sum(1 for tier, _, _ in self.blocks if tier == "host")


class HostTier:
    """The host copy of evicted prefix blocks: hash -> host block, least recently stored evicted first."""

    __slots__ = ("num_blocks", "free", "cached", "block_hash", "block_keys", "released_at")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.block_keys: dict[int, BlockKey] = {}
        self.released_at: dict[int, float] = {}  # when the block's last device user let go (with a TTL)

    def store(self, h: int, key: BlockKey, released_at: float | None = None) -> int | None:
        """A host block for this hash (evicting the least recently stored one); None if the tier has none."""
        if h in self.cached:
            return None
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        self.forget(block)
        self.cached[h], self.block_hash[block], self.block_keys[block] = block, h, key
        if released_at is not None:
            self.released_at[block] = released_at
        self.free[block] = None  # every host block is evictable: none is ever referenced by a sequence
        return block

    def forget(self, block: int) -> None:
        """Drop the block's entry, if it holds one (it stays where it is in the free order)."""
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.cached[h], self.block_keys[block]
            self.released_at.pop(block, None)

    def pin(self, block: int) -> None:
        """Keep the block from eviction while it waits to be copied back."""
        del self.free[block]

    def release(self, block: int) -> None:
        """The block moved to the device: forget it here (the tiers are exclusive) and reuse it first."""
        self.forget(block)
        self.free[block] = None
        self.free.move_to_end(block, last=False)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, prefix_cache_ttl: float | None = None,
                 window: KVWindow | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # StreamingLLM: a sequence's table never covers more than the window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hash: dict[int, int] = {}  # block id -> hash, for full computed blocks
        self.block_keys: dict[int, BlockKey] = {}  # block id -> its hash's key, to rule out collisions
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self.pending_copies: list[BlockCopy] = []
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0
        self.swapped_out = 0
        self.swapped_in = 0
        # a cached device block no sequence has used for this many seconds is forgotten (None: kept until evicted)
        self.prefix_cache_ttl = prefix_cache_ttl
        self.released_at: dict[int, float] = {}  # cached free block -> when its last user let go (monotonic)
        self.expired_blocks = 0
        self._next_expiry = 0.0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens of one sequence (under a window: those it keeps)."""
        return blocks_for(self.window.kept(num_tokens) if self.window else num_tokens, self.block_size)

    def request_blocks(self, num_prompt_tokens: int, max_num_tokens: int, num_samples: int) -> int:
        return request_blocks(num_prompt_tokens, max_num_tokens, num_samples, self.block_size, self.window)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    # ----- prefix cache -----

    def _key(self, parent: int | None, tokens: tuple[int, ...], extra: object = None) -> tuple[int, BlockKey]:
        """A block's key and its hash."""
        key = (parent, tokens, extra)
        return hash(key), key

    def _extra(self, seq: Sequence, i: int) -> object:
        """Block i's extra key: the sequence's salt, and the content hashes of the images whose placeholders it
        holds (equal placeholder tokens with another image must miss)."""
        items = seq.request.record.mm_inputs
        if not items:
            return seq.cache_salt
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        images = tuple(m.hash for m in items if m.placeholder.overlaps(lo, hi))
        return (seq.cache_salt, images) if images else seq.cache_salt

    def lookup(self, seq: Sequence) -> PrefixHit:
        """Cached blocks that hold seq's leading full blocks; at least one token is always left to compute."""
        hit = PrefixHit()
        if not (self.enable_prefix_caching or seq.caches_prefix) or seq.num_computed_tokens or seq.block_table:
            return hit
        bs, parent = self.block_size, None
        for i in range((seq.num_tokens - 1) // bs):
            h, key = self._key(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), self._extra(seq, i))
            block = self.cached.get(h)
            if block is not None and self.block_keys[block] == key:
                hit.blocks.append(("device", block, h))
            elif self.host is not None and (hb := self.host.cached.get(h)) is not None \
                    and self.host.block_keys[hb] == key:
                hit.blocks.append(("host", hb, h))
            else:
                break
            parent = h
        return hit

    def blocks_to_take(self, hit: PrefixHit) -> int:
        """Free-queue blocks that taking this hit uses: revived device blocks and a fresh block per host block."""
        return sum(1 for tier, b, _ in hit.blocks if tier == "host" or self.ref_counts[b] == 0)

    def take_cached(self, seq: Sequence, hit: PrefixHit) -> tuple[int, int]:
        """Give seq the blocks found by lookup, copying host blocks back; returns (device tokens, host tokens)."""
        # claim every block of the hit first: the fresh device blocks for the host hits may evict cached blocks
        # (to the host tier), and neither the hit's device blocks nor its host blocks may be the ones they take
        for tier, block, _ in hit.blocks:
            if tier == "host":
                self.host.pin(block)
            else:
                if self.ref_counts[block] == 0:
                    del self.free_blocks[block]
                self.ref_counts[block] += 1
        for tier, block, h in hit.blocks:
            if tier == "device":
                seq.block_table.append(block)
                continue
            key = self.host.block_keys[block]
            device_block = self._pop_free()
            self.ref_counts[device_block] = 1
            # after that eviction's copy, in order
            self.pending_copies.append(BlockCopy(CopyKind.SWAP_IN, block, device_block))
            self.host.release(block)
            self.swapped_in += 1
            self.cached[h], self.block_hash[device_block], self.block_keys[device_block] = device_block, h, key
            seq.block_table.append(device_block)
        bs, host = self.block_size, hit.num_host * self.block_size
        cached = hit.num_blocks * bs
        seq.num_hashed_blocks = hit.num_blocks
        if self.enable_prefix_caching:  # the counters describe the prefix cache users turned on
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += cached
            self.host_hit_tokens += host
        return cached - host, host

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register seq's full blocks up to num_tokens (default: its computed tokens) in the prefix cache.

        The scheduler registers the blocks a step is about to compute as it schedules them, so that a request
        admitted later in the same step takes them instead of computing the same prefix again (64 requests with
        one 384-token system prompt arriving together: 4 of the first step's 5 prompts recomputed it). That is
        sound because every layer writes the whole batch's K/V before any row attends, and a batch's rows run in
        scheduling order on every pipeline stage (micro-batches included); the blocks are referenced by their
        sequence until the step has run, so they cannot be evicted first, and a failed step stops the engine."""
        if not (self.enable_prefix_caching or seq.caches_prefix):
            return
        bs = self.block_size
        done = seq.num_computed_tokens if num_tokens is None else num_tokens
        full = min(done // bs, len(seq.block_table))
        parent = self.block_hash.get(seq.block_table[seq.num_hashed_blocks - 1]) if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            h = self.block_hash.get(block)
            if h is None:
                h, key = self._key(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), self._extra(seq, i))
                if h not in self.cached:  # an equal block computed twice: keep the first, this one stays private
                    self.cached[h] = block
                    self.block_hash[block] = h
                    self.block_keys[block] = key
                    if self.host is not None and (hb := self.host.cached.get(h)) is not None:
                        self.host.release(hb)  # computed again where lookup could not reach it (a prompt's last
                        # block): the tiers stay exclusive and the host block is free for another
                else:
                    seq.num_hashed_blocks = i  # a private block breaks the chain for the blocks after it
                    return
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ----- allocation -----

    def _pop_free(self) -> int:
        """The least recently used free block; a cached one is evicted, to the host tier where there is one."""
        block, _ = self.free_blocks.popitem(last=False)
        assert self.ref_counts[block] == 0, f"block {block} on the free list has references"
        h = self.block_hash.pop(block, None)
        released = self.released_at.pop(block, None)
        if h is not None:
            del self.cached[h]
            key = self.block_keys.pop(block)
            if self.host is not None:
                hb = self.host.store(h, key, released)
                if hb is not None:
                    self.pending_copies.append(BlockCopy(CopyKind.SWAP_OUT, block, hb))
                    self.swapped_out += 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            block = self._pop_free()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Let child, holding no block yet, reference parent's first num_blocks blocks (and their KV)."""
        assert not child.block_table
        for block in parent.block_table[:num_blocks]:
            self.ref_counts[block] += 1
            child.block_table.append(block)
        child.num_hashed_blocks = min(parent.num_hashed_blocks, len(child.block_table))

    def append_copy(self, seq: Sequence, source: int) -> bool:
        """Append to seq's table a fresh block that gets source's KV (a queued copy), so that seq writes its own
        tokens there; False, and nothing appended, when no block is free."""
        if not self.free_blocks:
            return False
        block = self._pop_free()
        self.ref_counts[block] = 1
        self.pending_copies.append(BlockCopy(CopyKind.COPY, source, block))
        seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail first: it is evicted before the shared head
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.prefix_cache_ttl is not None and block in self.block_hash:
                    self.released_at[block] = time.monotonic()
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def expire(self, now: float) -> None:
        """Forget cached free blocks unused for prefix_cache_ttl seconds (checked at most every 0.5 s), on the
        device and in the host tier (a block keeps the time its last user let go when it is evicted there). Both
        free lists are in release order, so each walk stops at the first cached block that is still fresh."""
        if self.prefix_cache_ttl is None or now < self._next_expiry:
            return
        self._next_expiry = now + 0.5
        cutoff = now - self.prefix_cache_ttl
        for block in self.free_blocks:
            h = self.block_hash.get(block)
            if h is None:
                continue
            if self.released_at.get(block, now) > cutoff:
                break
            del self.cached[h], self.block_hash[block], self.block_keys[block]
            self.released_at.pop(block, None)
            self.expired_blocks += 1
        if self.host is not None:
            for block in list(self.host.free):
                if block not in self.host.block_hash:
                    continue
                if self.host.released_at.get(block, now) > cutoff:
                    break
                self.host.forget(block)
                self.expired_blocks += 1

    def uncache(self, seq: Sequence) -> None:
        """Forget the prefix-cache entries of seq's blocks: their KV is not what their keys say (computed with an
        adapter the worker could not read). Only sequences with the same key salt could share them."""
        for block in seq.block_table:
            h = self.block_hash.pop(block, None)
            if h is not None:
                del self.cached[h], self.block_keys[block]
                self.released_at.pop(block, None)
        seq.num_hashed_blocks = 0

    def take_copies(self) -> list[BlockCopy]:
        """The block copies queued since the last call, in the order they must run."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
