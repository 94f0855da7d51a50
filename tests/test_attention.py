"""Decode attention, both of its layouts, against torch's SDPA on repeated KV heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember.layers.attention as attention


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (4, 1), (12, 6)])
@pytest.mark.parametrize("block_diagonal", [True, False])
def test_decode_attention_matches_sdpa(heads, kv_heads, block_diagonal, monkeypatch):
    monkeypatch.setattr(attention, "_BLOCK_DIAGONAL_MAX_KV_HEADS", 100 if block_diagonal else 0)
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    nd, S, D = 5, 40, 16
    q = torch.randn(nd, heads, D, generator=g)
    k = torch.randn(nd, S, kv_heads, D, generator=g)
    v = torch.randn(nd, S, kv_heads, D, generator=g)
    lens = torch.randint(1, S + 1, (nd,), generator=g)
    mask = (torch.arange(S)[None] < lens[:, None])[:, None, None, :]
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(rep, 2).transpose(1, 2),
                                         v.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(attention._decode_attention(q, k, v, mask, 0.25), ref[:, :, 0])
