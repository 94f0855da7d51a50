"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts, prefix caching.

Blocks are shared by reference count: the siblings of an n > 1 request point at the prompt's full blocks, and with
prefix caching any request whose prompt starts with the same full blocks as an earlier one reuses their KV.

Prefix caching (vLLM's design): once a block is full and computed it gets a hash of (parent block's hash, its token
ids) (extra keys such as a LoRA name join the tuple when LoRA lands); a new sequence walks its full blocks and takes every block whose hash is cached and whose tokens
are equal (a hash collision can never serve wrong KV). A block whose last reference goes keeps its hash and waits
in the free queue in least-recently-freed order; allocation takes from the front and only then forgets the hash,
so only unreferenced blocks are evicted, least recently used first. Nothing here touches tensors.
"""

from __future__ import annotations

from collections import OrderedDict

from ember.core.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hash: dict[int, int] = {}  # block id -> hash, for full computed blocks
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # block id -> its token ids, to rule out collisions
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table covers num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    # ----- prefix cache -----

    def _hash(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold seq's leading full blocks; at least one token is always left to compute."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._hash(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def revived(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit in the free queue (taking them uses free capacity)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take_cached(self, seq: Sequence, blocks: list[int]) -> int:
        """Give seq the cached blocks found by lookup; returns the prompt tokens they hold."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_hashed_blocks = len(blocks)
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = self.block_hash.get(seq.block_table[seq.num_hashed_blocks - 1]) if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.block_hash.get(block)
            if h is None:
                h = self._hash(parent, tokens)
                if h not in self.cached:  # an equal block computed twice: keep the first, this one stays private
                    self.cached[h] = block
                    self.block_hash[block] = h
                    self.block_tokens[block] = tokens
                else:
                    seq.num_hashed_blocks = i  # a private block breaks the chain for the blocks after it
                    return
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # ----- allocation -----

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            block, _ = self.free_blocks.popitem(last=False)
            assert self.ref_counts[block] == 0, f"block {block} on the free list has references"
            h = self.block_hash.pop(block, None)
            if h is not None:  # evict the least recently used cached block
                del self.cached[h]
                del self.block_tokens[block]
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Let child reuse parent's first num_tokens tokens of KV (whole blocks only)."""
        assert num_tokens % self.block_size == 0 and not child.block_table
        for block in parent.block_table[: num_tokens // self.block_size]:
            self.ref_counts[block] += 1
            child.block_table.append(block)
        child.num_hashed_blocks = min(parent.num_hashed_blocks, len(child.block_table))

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail first: it is evicted before the shared head
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
