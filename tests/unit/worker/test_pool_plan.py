"""Sizing the KV pool is a pure function of the budget and the limits."""

from __future__ import annotations

from ember.worker.startup import plan_num_blocks


def test_the_budget_decides_up_to_what_every_seat_needs():
    # 1 MiB at 4 KiB a block: 256 blocks; 4 seats x 512 tokens / 16 a block = 128 blocks at most
    assert plan_num_blocks(2**20, 4096, 16, 512, 4) == 128
    assert plan_num_blocks(2**20, 4096, 16, 512, 64) == 256
    assert plan_num_blocks(2**20, 4096, 16, 500, 4) == 128  # a partial last block counts whole


def test_max_tokens_caps_the_pool_and_a_negative_budget_gives_none():
    assert plan_num_blocks(2**20, 4096, 16, 512, 64, max_tokens=100) == 7
    assert plan_num_blocks(-5, 4096, 16, 512, 4) == 0
