"""The worker's block copies: runs of one kind in the block manager's order, each destination written once, by the
last copy to it (``index_copy_`` leaves a repeated index's order undefined)."""

from __future__ import annotations

from ember.core.block_manager import HostTier
from ember.protocol import BlockCopy, CopyKind
from ember.worker.worker import copy_runs


def test_a_host_tier_smaller_than_a_steps_evictions_stores_two_blocks_in_one():
    """What makes a repeated destination: a tier of one block given two evicted blocks in one step."""
    tier = HostTier(1)
    assert tier.store(11, (None, (1, 2), None)) == tier.store(12, (None, (3, 4), None)) == 0
    assert tier.cached == {12: 0}  # the second replaced the first


def test_each_destination_takes_its_last_copy_and_runs_keep_their_order():
    copies = [BlockCopy(CopyKind.SWAP_OUT, 5, 0), BlockCopy(CopyKind.SWAP_OUT, 6, 1),
              BlockCopy(CopyKind.SWAP_OUT, 7, 0), BlockCopy(CopyKind.SWAP_IN, 0, 9),
              BlockCopy(CopyKind.SWAP_OUT, 8, 0), BlockCopy(CopyKind.COPY, 2, 3)]
    runs = copy_runs(copies)
    assert [kind for kind, _, _ in runs] == [CopyKind.SWAP_OUT, CopyKind.SWAP_IN, CopyKind.SWAP_OUT, CopyKind.COPY]
    out = dict(zip(runs[0][2], runs[0][1]))
    assert out == {0: 7, 1: 6}  # host block 0 holds block 7's KV, the one its hash now names
    assert runs[1][1:] == ([0], [9]) and runs[2][1:] == ([8], [0]) and runs[3][1:] == ([2], [3])
    assert copy_runs([]) == []
