"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, reference counts.

Blocks are shared by reference count: the siblings of an n > 1 request point at the prompt's full blocks. A block
returns to the free list when its last reference goes. Nothing here touches tensors; the model runner owns those.
"""

from __future__ import annotations

from collections import deque

from ember.core.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

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

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self.free_blocks)} free")
        for _ in range(need):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0, f"block {block} on the free list has references"
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Let child reuse parent's first num_tokens tokens of KV (whole blocks only)."""
        assert num_tokens % self.block_size == 0 and not child.block_table
        for block in parent.block_table[: num_tokens // self.block_size]:
            self.ref_counts[block] += 1
            child.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
