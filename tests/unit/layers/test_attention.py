"""Decode attention (the torch layouts and the compiled CPU kernel) against SDPA; the fused add + RMSNorm kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ember.layers.attention as attention
from ember.kernels import kernels_for


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


def _paged(nd, heads, kv_heads, D, bs, lens, dtype, g):
    """Random K/V scattered over a shuffled block pool, as the engine's allocator leaves them."""
    per_seq = -(-max(lens) // bs)
    pool = nd * per_seq + 3
    k_cache = torch.randn(pool, bs, kv_heads, D, generator=g).to(dtype)
    v_cache = torch.randn(pool, bs, kv_heads, D, generator=g).to(dtype)
    tables = torch.randperm(pool, generator=g)[:nd * per_seq].view(nd, per_seq)
    q = torch.randn(nd, heads, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (8, 8, None), (4, 1, 20), (12, 6, 7), (14, 2, None)])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_cpu_kernel_matches_sdpa_on_the_block_pool(dtype, heads, kv_heads, window, D):
    """ember's compiled paged decode attention against SDPA on the same context gathered by hand (bf16 with D 64, 128
    or 256 takes the AVX512-BF16 path where the machine has it), a batch of sequences and each alone (one sequence
    with fewer KV heads than threads splits its keys' layout over the threads)."""
    kernels = kernels_for(torch.device("cpu"))
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine (the torch path is tested above)")
    g = torch.Generator().manual_seed(heads + kv_heads)
    bs = 16
    lens = [1, 16, 17, 45, 70]
    q, kc, vc, tables, lens_t = _paged(len(lens), heads, kv_heads, D, bs, lens, dtype, g)
    out = kernels.paged_decode_attention(q, kc, vc, tables, lens_t, window or 0, 0.2)
    alone = torch.cat([kernels.paged_decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens_t[i:i + 1],
                                                      window or 0, 0.2) for i in range(len(lens))])
    torch.testing.assert_close(alone, out, atol=0, rtol=0)
    rep = heads // kv_heads
    for i, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        k = kc[tables[i]].reshape(-1, kv_heads, D)[first:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        v = vc[tables[i]].reshape(-1, kv_heads, D)[first:n].float().repeat_interleave(rep, 1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=0.2)[:, 0]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,D,bs", [(9, 3, 64, 16), (14, 2, 64, 16), (4, 4, 128, 32), (8, 1, 64, 8),
                                                 (6, 2, 48, 16), (4, 1, 256, 16), (8, 2, 256, 32)])
def test_cpu_prefill_kernel_matches_sdpa_over_the_paged_context(heads, kv_heads, D, bs, dtype):
    """ember's prefill attention (the AVX512-BF16 kernel for bf16 with head size 64 / 128 / 256 where it is built, the
    portable one otherwise) against SDPA with an explicit causal / window mask on the context gathered by hand:
    fresh prompts, chunks after cached context, windows cutting blocks."""
    kernels = kernels_for(torch.device("cpu"))
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    g = torch.Generator().manual_seed(heads * D + bs)
    for length, ctx in ((1, 1), (5, 5), (33, 33), (40, 100), (100, 100), (7, 64)):
        for window in (0, 5, 37):
            nbl = -(-ctx // bs) + 1
            kc = torch.randn(nbl + 4, bs, kv_heads, D, generator=g).to(dtype)
            vc = torch.randn(nbl + 4, bs, kv_heads, D, generator=g).to(dtype)
            table = torch.randperm(nbl + 4, generator=g)[:nbl]
            q = (torch.randn(length, heads, D, generator=g) * 2).to(dtype)
            out = kernels.paged_prefill_attention(q, kc, vc, table, ctx, window, D ** -0.5).float()
            rep = heads // kv_heads
            k = kc[table].reshape(-1, kv_heads, D)[:ctx].float().repeat_interleave(rep, 1).transpose(0, 1)
            v = vc[table].reshape(-1, kv_heads, D)[:ctx].float().repeat_interleave(rep, 1).transpose(0, 1)
            rows, cols = torch.arange(ctx - length, ctx)[:, None], torch.arange(ctx)[None]
            mask = (cols <= rows) & ((cols > rows - window) if window else True)
            ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=D ** -0.5)
            # bf16 output and P rounded to bf16 before P.V
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(out, ref.transpose(0, 1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_write_kernel_equals_index_copy(dtype):
    """K/V rows strided inside a fused QKV output, written to their slots in one pass, as two index_copy_ would."""
    kernels = kernels_for(torch.device("cpu"))
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(11, 15 * 64, generator=g).to(dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(11, 3, 64), qkv[:, 12 * 64:].view(11, 3, 64)
    slots = torch.randperm(8 * 16, generator=g)[:11]
    pools = [torch.randn(8, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    pools += [p.clone() for p in pools]
    kernels.write_kv_(pools[0], pools[1], k, v, slots)
    pools[2].view(-1, 3, 64).index_copy_(0, slots, k)
    pools[3].view(-1, 3, 64).index_copy_(0, slots, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(RuntimeError, match=r"write_kv_: slots\[0\] = \d+ is outside the pool's 128 slots"):
        kernels.write_kv_(pools[0], pools[1], k, v, slots + 8 * 16)


def test_cpu_silu_and_mul_kernel_matches_eager_within_one_bf16_step():
    from ember.layers.activation import silu_and_mul

    kernels = kernels_for(torch.device("cpu"))
    if kernels is None or not kernels.has_avx512_bf16():
        pytest.skip("the AVX512-BF16 kernels are not built on this machine (eager runs)")
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(37, 2 * 1536, generator=g) * 4).bfloat16()
    want = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    got = silu_and_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert (got == want).float().mean().item() > 0.99  # almost every value bit-equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256, 48])
def test_cpu_rotary_kernel_equals_eager_rope_bit_for_bit(dtype, d):
    """The in-place RoPE kernel on the Q/K slice of a fused QKV output (rows strided) against apply_rotary, bits
    compared (signed zeros included); head sizes of the vector path (64, 128, 256: Gemma) and of the scalar loop
    (48)."""
    from ember.layers.rotary import apply_rotary, rotate_in_place

    if kernels_for(torch.device("cpu")) is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, 15 * d, generator=g).to(dtype)
    qkv[::5, ::7] = 0.0
    x = qkv[:, :12 * d].view(37, 12, d)
    cos, sin = torch.randn(37, 1, d, generator=g).to(dtype), torch.randn(37, 1, d, generator=g).to(dtype)
    want, v_before = apply_rotary(x, cos, sin), qkv[:, 12 * d:].clone()
    got = rotate_in_place(x, cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(qkv[:, 12 * d:], v_before)  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_add_rms_norm_matches_the_torch_path(dtype):
    """The kernel's residual add + RMSNorm against the eager transformers-style arithmetic it replaces."""
    from ember.layers.norm import RMSNorm

    kernels = kernels_for(torch.device("cpu"))
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x, residual = (torch.randn(37, 96, generator=g).to(dtype) * 3 for _ in range(2))
    want_sum = x + residual
    want = norm._norm(want_sum)
    got, got_sum = norm(x.clone(), residual.clone())
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(norm(x), norm._norm(x), rtol=tol, atol=tol)


def test_a_build_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    """torch's extension builder waits forever on a `lock` file a killed build left behind; ember's own flock
    lets the next process see the file is stale and remove it."""
    from ember.kernels import _build_lock

    (tmp_path / "lock").write_text("")
    with _build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_layers_call_forward_directly_and_still_run_hooks():
    """ember's layers skip torch's hook dispatch while none is set; a module's own hooks and global module hooks
    still run (calibration captures projection inputs with forward pre-hooks)."""
    from torch.nn.modules.module import register_module_forward_hook

    from ember.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6, torch.float32)
    x = torch.randn(3, 64)
    want = norm(x)
    seen = []
    handle = norm.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    out_handle = norm.register_forward_hook(lambda m, args, out: out * 2)
    assert torch.equal(norm(x), want * 2) and seen == [("pre", x.shape)]
    handle.remove()
    out_handle.remove()
    glob = register_module_forward_hook(lambda m, args, out: seen.append("global"))
    try:
        assert torch.equal(norm(x), want) and seen[-1] == "global"
    finally:
        glob.remove()
    assert torch.equal(norm(x), want) and len(seen) == 2
