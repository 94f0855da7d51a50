"""Sizing the KV pool is a pure function of the budget and the limits; the step that measures the activations
holds the step's tokens in prompts that cost what the longest would."""

from __future__ import annotations

from types import SimpleNamespace

from ember.worker.startup import (MEASURING_PROMPT, dummy_prefill, long_prompt_bytes, measuring_prompt_len,
                                  plan_num_blocks)


def test_the_budget_decides_up_to_what_every_seat_needs():
    # 1 MiB at 4 KiB a block: 256 blocks; 4 seats x 512 tokens / 16 a block = 128 blocks at most
    assert plan_num_blocks(2**20, 4096, 16, 512, 4) == 128
    assert plan_num_blocks(2**20, 4096, 16, 512, 64) == 256
    assert plan_num_blocks(2**20, 4096, 16, 500, 4) == 128  # a partial last block counts whole


def test_max_tokens_caps_the_pool_and_a_negative_budget_gives_none():
    assert plan_num_blocks(2**20, 4096, 16, 512, 64, max_tokens=100) == 7
    assert plan_num_blocks(-5, 4096, 16, 512, 4) == 0


class _Backend:
    def __init__(self, linear: bool) -> None:
        self.linear = linear

    def prefill_memory_is_linear(self, layer, dtype) -> bool:
        return self.linear


class _Worker:
    """What start-up's measuring reads of a worker: its layers (heads, pool, backend), dtype, device, block size;
    forward_stage keeps what it was given."""

    def __init__(self, *backends) -> None:
        import torch

        self.device, self.block_size = torch.device("cpu"), 16
        self.loaded = SimpleNamespace(dtype=torch.float32)
        self.layers = [SimpleNamespace(backend=b, num_heads=9, head_dim=64, k_cache=torch.empty(40, 16, 3, 64))
                       for b in backends]

    def forward_stage(self, ids, positions, meta):
        self.seen = ids, positions, meta


def test_measuring_takes_short_prompts_only_where_every_layer_s_attention_memory_is_linear():
    assert measuring_prompt_len(_Worker(_Backend(True), _Backend(True)), 2048) == MEASURING_PROMPT
    assert measuring_prompt_len(_Worker(_Backend(True), _Backend(True)), 100) == 100
    assert measuring_prompt_len(_Worker(_Backend(True), _Backend(False)), 2048) == 2048  # SDPA: the longest prompt
    assert measuring_prompt_len(_Worker(_Backend(True), None), 2048) == 2048
    # a 1,024-token prompt's attention output (9 heads x 64 float32) and lengths, beyond 256-token prompts'
    assert long_prompt_bytes(_Worker(_Backend(True)), 1024, 256) == 768 * (9 * 64 * 4 + 8)
    assert long_prompt_bytes(_Worker(_Backend(True)), 256, 256) == 0


def test_the_dummy_step_holds_every_token_in_prompts_from_position_zero():
    import torch

    w = _Worker(_Backend(True))
    dummy_prefill(w, 600, 4, 256)
    ids, positions, meta = w.seen
    assert ids.shape == (600,) and meta.num_decode == 0
    assert [(s.start, s.length, s.context_len) for s in meta.prefills] == [(0, 256, 256), (256, 256, 256),
                                                                           (512, 88, 88)]
    assert torch.equal(positions, torch.cat([torch.arange(256), torch.arange(256), torch.arange(88)]))
    assert meta.slot_mapping.shape == (600,) and int(meta.slot_mapping.max()) < 40 * 16  # inside the pool
    dummy_prefill(w, 300, 4)  # one prompt of all the tokens
    assert [(s.start, s.length) for s in w.seen[2].prefills] == [(0, 300)]


def test_the_host_tier_is_sized_only_with_prefix_caching(monkeypatch):
    """It holds evicted prefix blocks: with prefix caching off the core uses none, so none is allocated (pinned
    memory on CUDA)."""
    import torch

    from ember.config import CacheConfig
    from ember.worker.memory import host_tier_bytes

    monkeypatch.setenv("EMBER_HOST_TIER_ON_CPU", "1")
    on = CacheConfig(16, "auto", None, None, "default", None, "1MiB", True, None)
    assert host_tier_bytes(on, torch.device("cpu")) == 2**20
    off = CacheConfig(16, "auto", None, None, "default", None, "1MiB", False, None)
    assert host_tier_bytes(off, torch.device("cpu")) == 0
