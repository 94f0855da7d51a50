"""The compiled CPU kernels check their arguments at entry: a wrong device, dtype, rank, size, layout, or index data
pointing outside the pool raises a RuntimeError naming the kernel and the argument, in this process, before any
memory is read (a missing check would crash the test run, not fail one test). Inputs a kernel copies (a
non-contiguous x or q) give the contiguous input's result; empty batches give empty results."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_kernels
from ember.quantization import quantize_int4, quantize_int8
from ember.quantization.kernels import _scale_zeros, block_scale_zeros, pack_cpu_int4


@pytest.fixture(scope="module")
def k():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    return kernels


def _avx512(k) -> None:
    if not k.has_avx512_bf16():
        pytest.skip("needs the AVX512-BF16 build")


def _meta(t: torch.Tensor) -> torch.Tensor:
    """The same tensor on no device: a kernel that read it as a CPU pointer would crash."""
    return torch.empty_like(t, device="meta")


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """t's values and shape with the first two dims' strides swapped."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _raises(fn, *args, match: str, **kw) -> None:
    with pytest.raises(RuntimeError, match=match):
        fn(*args, **kw)


# ----- paged attention -----

def _decode_args(dtype=torch.float32, heads=4, kv_heads=2, D=16, bs=4, lens=(5, 9, 1)):
    g = torch.Generator().manual_seed(0)
    per_seq = -(-max(lens) // bs)
    pool = len(lens) * per_seq + 1
    kc = torch.randn(pool, bs, kv_heads, D, generator=g).to(dtype)
    vc = torch.randn(pool, bs, kv_heads, D, generator=g).to(dtype)
    tables = torch.randperm(pool, generator=g)[:len(lens) * per_seq].view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, D, generator=g).to(dtype)
    return [q, kc, vc, tables, torch.tensor(lens), 0, 0.25]


def _with(args: list, i: int, value) -> list:
    return [*args[:i], value, *args[i + 1:]]


@pytest.mark.parametrize("case,match", [
    ("q int32", r"paged_decode_attention: q must be one of Float, BFloat16, Half, got Int"),
    ("q on meta", r"paged_decode_attention: q must be a CPU tensor, got one on meta"),
    ("k_cache on meta", r"k_cache must be a CPU tensor"),
    ("k_cache half", r"k_cache must have q's dtype Float, got Half"),
    ("q 2 dims", r"q must be \[tokens, query_heads, head_dim\] \(3 dims\), got shape \[3, 64\]"),
    ("q head_dim 8", r"q.size\(2\) must be 16 \(k_cache's head_dim\), got 8"),
    ("v_cache other shape", r"v_cache must have k_cache's shape"),
    ("k_cache strided", r"k_cache must be contiguous"),
    ("heads 5", r"q's 5 query heads must be a multiple of the 2 KV heads"),
    ("block_tables int32", r"block_tables must be Long, got Int"),
    ("block_tables 1 dim", r"block_tables must be \[num_queries, max_blocks\]"),
    ("block_tables 2 rows", r"block_tables.size\(0\) must be 3 \(one table a query\), got 2"),
    ("context_lens 2", r"context_lens must be \[3\] \(one length a query\), got shape \[2\]"),
    ("block past the pool", r"block_tables\[1, 2\] = 10 is outside the pool of 10 blocks"),
    ("negative block", r"block_tables\[0, 0\] = -1 is outside the pool of 10 blocks"),
    ("length past the table", r"context_lens\[2\] = 13 is outside 0..12 \(3 table entries of 4 tokens\)"),
    ("negative length", r"context_lens\[0\] = -1 is outside"),
])
def test_paged_decode_attention_rejects(k, case, match):
    args = _decode_args()
    q, kc, vc, tables, lens = args[:5]
    if case == "q int32":
        args = _with(args, 0, q.int())
    elif case == "q on meta":
        args = _with(args, 0, _meta(q))
    elif case == "k_cache on meta":
        args = _with(args, 1, _meta(kc))
    elif case == "k_cache half":
        args = _with(args, 1, kc.half())
    elif case == "q 2 dims":
        args = _with(args, 0, q.reshape(3, -1))
    elif case == "q head_dim 8":
        args = _with(args, 0, q[..., :8])
    elif case == "v_cache other shape":
        args = _with(args, 2, vc[:-1])
    elif case == "k_cache strided":
        args = _with(args, 1, _noncontiguous(kc))
    elif case == "heads 5":
        args = _with(args, 0, torch.randn(3, 5, 16))
    elif case == "block_tables int32":
        args = _with(args, 3, tables.int())
    elif case == "block_tables 1 dim":
        args = _with(args, 3, tables.reshape(-1))
    elif case == "block_tables 2 rows":
        args = _with(args, 3, tables[:2])
    elif case == "context_lens 2":
        args = _with(args, 4, lens[:2])
    elif case == "block past the pool":  # sequence 1 (9 tokens) reads three blocks: its third is the pool's size
        tables = tables.clone()
        tables[1, 2] = kc.shape[0]
        args = _with(args, 3, tables)
    elif case == "negative block":
        tables = tables.clone()
        tables[0, 0] = -1
        args = _with(args, 3, tables)
    elif case == "length past the table":
        args = _with(args, 4, torch.tensor([5, 9, 13]))
    elif case == "negative length":
        args = _with(args, 4, torch.tensor([-1, 9, 1]))
    _raises(k.paged_decode_attention, *args, match=match)


def test_paged_decode_attention_reads_only_the_blocks_a_length_covers(k):
    """Table entries past a sequence's length are padding (any value): only the blocks it reads are checked, and
    the result is the same as with those entries in range. A strided q is copied, not refused."""
    args = _decode_args()
    want = k.paged_decode_attention(*args)
    tables = args[3].clone()
    tables[2, 1:] = 10 ** 9  # sequence 2 has one token: one block
    q = args[0].transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(k.paged_decode_attention(q, *args[1:3], tables, *args[4:]), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,D", [(torch.float32, 16), (torch.bfloat16, 64)])
@pytest.mark.parametrize("case,match", [
    ("block past the pool", r"paged_prefill_attention: block_table\[1\] = 10 is outside the pool of 10 blocks"),
    ("negative block", r"paged_prefill_attention: block_table\[0\] = -5 is outside the pool"),
    ("context past the table", r"context_len = 13 must cover the chunk's 3 queries and fit the block table's 3 "
                               r"blocks of 4 tokens"),
    ("context shorter than the chunk", r"context_len = 2 must cover the chunk's 3 queries"),
    ("block_table int32", r"paged_prefill_attention: block_table must be Long, got Int"),
    ("block_table 2 dims", r"block_table must be \[blocks\] \(1 dims\)"),
    ("q on meta", r"paged_prefill_attention: q must be a CPU tensor"),
    ("k_cache strided", r"paged_prefill_attention: k_cache must be contiguous"),
])
def test_paged_prefill_attention_rejects(k, dtype, D, case, match):
    """Both kernels (the portable one for float32, the AVX512-BF16 one for bf16 with head size 64 where built)."""
    _, kc, vc, tables, _, window, scale = _decode_args(dtype, D=D)
    q = torch.randn(3, 4, D).to(dtype)
    table, context = tables[1].clone(), 9
    if case == "block past the pool":
        table[1] = kc.shape[0]
    elif case == "negative block":
        table[0] = -5
    elif case == "context past the table":
        context = 13
    elif case == "context shorter than the chunk":
        context = 2
    elif case == "block_table int32":
        table = table.int()
    elif case == "block_table 2 dims":
        table = table[None]
    elif case == "q on meta":
        q = _meta(q)
    elif case == "k_cache strided":
        kc = _noncontiguous(kc)
    _raises(k.paged_prefill_attention, q, kc, vc, table, context, window, scale, match=match)


# ----- quantized GEMMs -----

def _int4_args(N=128, K=128, group=32, M=3):
    torch.manual_seed(0)
    qt = quantize_int4(torch.randn(N, K), group)
    w, sz = pack_cpu_int4(qt.unpacked()), block_scale_zeros(_scale_zeros(qt))
    return [torch.randn(M, K).bfloat16(), w, sz, group], qt


@pytest.mark.parametrize("case,match", [
    ("x float32", r"int4_gemm: x must be BFloat16, got Float"),
    ("x on meta", r"int4_gemm: x must be a CPU tensor, got one on meta"),
    ("w int8", r"int4_gemm: w must be Byte, got Char"),
    ("w short", r"int4_gemm: w must hold N \* K / 2 = 8192 bytes \(N = 128 from scale_zeros, K = 128 from x\)"),
    ("group 0", r"int4_gemm: group = 0 must be a positive multiple of 4 that divides x's K = 128"),
    ("group 6", r"group = 6 must be a positive multiple of 4"),
    ("group 48", r"group = 48 must be a positive multiple of 4 that divides x's K = 128"),
    ("group 64", r"scale_zeros.size\(1\) must be 2 \(K / group\), got 4"),
    ("x 3 dims", r"int4_gemm: x must be \[M, K\] \(2 dims\), got shape \[1, 3, 128\]"),
    ("scale_zeros float32", r"scale_zeros must be one of BFloat16, Byte, got Float"),
    ("scale_zeros 3 dims", r"scale_zeros must be \[N/64, K/group, 64, 2\] \(4 dims\)"),
    ("x K 96", r"int4_gemm: scale_zeros.size\(1\) must be 3 \(K / group\), got 4"),
])
def test_int4_gemm_rejects(k, case, match):
    _avx512(k)
    (x, w, sz, group), _ = _int4_args()
    if case == "x float32":
        x = x.float()
    elif case == "x on meta":
        x = _meta(x)
    elif case == "w int8":
        w = w.view(torch.int8)
    elif case == "w short":
        w = w[:-1]
    elif case == "group 0":
        group = 0
    elif case == "group 6":
        group = 6
    elif case == "group 48":
        group = 48
    elif case == "group 64":
        group = 64
    elif case == "x 3 dims":
        x = x[None]
    elif case == "scale_zeros float32":
        sz = sz.float()
    elif case == "scale_zeros 3 dims":
        sz = sz[0]
    elif case == "x K 96":
        x = x[:, :96]
    _raises(k.int4_gemm, x, w, sz, group, match=match)


@pytest.mark.parametrize("invariant", [True, False])
def test_int4_gemm_copies_strided_inputs_and_takes_no_rows(k, invariant):
    """A strided x gives the contiguous x's bits; that result matches the dequantized weight (the reference);
    zero rows give [0, N]."""
    _avx512(k)
    (x, w, sz, group), qt = _int4_args(M=5)
    want = k.int4_gemm(x, w, sz, group, invariant)
    ref = x.float() @ qt.dequantize().t()
    assert ((want.float() - ref).norm() / ref.norm()).item() < 0.02
    strided = torch.randn(128, 5).bfloat16().t()
    strided.copy_(x)
    assert not strided.is_contiguous()
    assert torch.equal(k.int4_gemm(strided, w, sz, group, invariant), want)
    assert k.int4_gemm(x[:0], w, sz, group, invariant).shape == (0, 128)


def _int8_args(N=70, K=36, M=3):
    torch.manual_seed(0)
    qt = quantize_int8(torch.randn(N, K))
    return [torch.randn(M, K).bfloat16(), qt.data, qt.scales.view(-1).float()], qt


@pytest.mark.parametrize("case,match", [
    ("x float32", r"int8_gemm: x must be BFloat16, got Float"),
    ("w uint8", r"int8_gemm: w must be Char, got Byte"),
    ("w on meta", r"int8_gemm: w must be a CPU tensor"),
    ("scales bf16", r"int8_gemm: scales must be Float, got BFloat16"),
    ("w 1 dim", r"int8_gemm: w must be \[N, K\] \(2 dims\), got shape \[2520\]"),
    ("w K 32", r"int8_gemm: w.size\(1\) must be 36 \(x's K\), got 32"),
    ("scales 69", r"int8_gemm: scales must hold one scale a weight row, 70, got shape \[69\]"),
    ("panels N 70", r"int8_gemm: the panels \(invariant=False, more than 4 rows\) need N % 64 == 0 and an even K, "
                    r"got N = 70, K = 36"),
])
def test_int8_gemm_rejects(k, case, match):
    _avx512(k)
    (x, w, s), _ = _int8_args()
    invariant = True
    if case == "x float32":
        x = x.float()
    elif case == "w uint8":
        w = w.view(torch.uint8)
    elif case == "w on meta":
        w = _meta(w)
    elif case == "scales bf16":
        s = s.bfloat16()
    elif case == "w 1 dim":
        w = w.reshape(-1)
    elif case == "w K 32":
        w = w[:, :32]
    elif case == "scales 69":
        s = s[:69]
    elif case == "panels N 70":
        x, invariant = torch.randn(8, 36).bfloat16(), False
    _raises(k.int8_gemm, x, w, s, invariant, match=match)


@pytest.mark.parametrize("invariant", [True, False])
def test_int8_gemm_takes_any_width_strided_weights_and_no_rows(k, invariant):
    """K = 36 and N = 70 (no multiple of 16 or 64) against the dequantized weight; a strided weight is copied;
    zero rows give [0, N] (the row-wise kernel read four rows of x before); no inputs give zeros."""
    _avx512(k)
    (x, w, s), qt = _int8_args()
    y = k.int8_gemm(x, w, s, invariant)
    ref = x.float() @ qt.dequantize().t()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.01
    assert torch.equal(k.int8_gemm(x, _noncontiguous(w), s, invariant), y)
    assert k.int8_gemm(x[:0], w, s, invariant).shape == (0, 70)
    if invariant:  # no inputs: zeros, at every row count (13 rows: the tiles' path)
        for m in (3, 13):
            y0 = k.int8_gemm(x.new_zeros(m, 0), w.new_zeros(70, 0), s, True)
            assert torch.equal(y0, torch.zeros(m, 70, dtype=torch.bfloat16))


@pytest.mark.parametrize("case,match", [
    ("x float16", r"w8a8_linear: x must be one of BFloat16, Float, got Half"),
    ("x on meta", r"w8a8_linear: x must be a CPU tensor"),
    ("w float32", r"w8a8_linear: w must be Char, got Float"),
    ("w K 35", r"w8a8_linear: w.size\(1\) must be 36 \(x's K\), got 35"),
    ("w_scales 2 per row", r"w8a8_linear: w_scales must hold one scale a weight row, 70, got shape \[140\]"),
    ("w_scales float64", r"w8a8_linear: w_scales must be Float, got Double"),
    ("K 1", r"w8a8_linear: x's K must be at least 2 \(torch._int_mm, which the GEMM calls, returns wrong products "
            r"for K = 1"),
])
def test_w8a8_linear_rejects(k, case, match):
    (x, w, s), _ = _int8_args()
    x = x.float()
    if case == "x float16":
        x = x.half()
    elif case == "x on meta":
        x = _meta(x)
    elif case == "w float32":
        w = w.float()
    elif case == "w K 35":
        w = w[:, :35]
    elif case == "w_scales 2 per row":
        s = s.repeat(2)
    elif case == "w_scales float64":
        s = s.double()
    elif case == "K 1":
        x, w = torch.randn(13, 1), w[:, :1].contiguous()
    _raises(k.w8a8_linear, x, w, s, match=match)


def test_w8a8_linear_empty_batches_and_weights(k):
    """No rows, or a weight of no rows (its GEMM chunk was sized by dividing by N), give empty results."""
    (x, w, s), _ = _int8_args()
    assert k.w8a8_linear(x[:0].float(), w, s).shape == (0, 70)
    assert k.w8a8_linear(x.float(), w[:0], s[:0]).shape == (3, 0)


# ----- elementwise, norm, dense -----

def _rotary_args(T=3, H=2, D=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype),
            torch.randn(T, D, generator=g).to(dtype)]


@pytest.mark.parametrize("case,match", [
    ("x int32", r"rotary_: x must be one of Float, BFloat16, Half, got Int"),
    ("x on meta", r"rotary_: x must be a CPU tensor"),
    ("cos float32", r"rotary_: cos must have x's dtype BFloat16, got Float"),
    ("x 2 dims", r"rotary_: x must be \[T, H, D\] \(3 dims\)"),
    ("x heads strided", r"rotary_: x's heads must be contiguous \(strides \[>= 0, D, 1\]\), got strides"),
    ("odd head_dim", r"rotary_: x's head_dim must be even \(rotate-half\), got 31"),
    ("cos 2 rows", r"rotary_: cos must be \[T, D\] = \[3, 32\], got shape \[2, 32\]"),
    ("cos strided", r"rotary_: cos must be contiguous"),
    ("sin other shape", r"rotary_: sin must have cos's shape \[3, 32\], got \[96\]"),
])
def test_rotary_rejects(k, case, match):
    x, cos, sin = _rotary_args()
    if case == "x int32":
        x, cos, sin = x.int(), cos.int(), sin.int()
    elif case == "x on meta":
        x = _meta(x)
    elif case == "cos float32":
        cos = cos.float()
    elif case == "x 2 dims":
        x = x.reshape(3, -1)
    elif case == "x heads strided":
        x = _noncontiguous(x)
    elif case == "odd head_dim":
        x, cos, sin = x[..., :31].contiguous(), cos[:, :31].contiguous(), sin[:, :31].contiguous()
    elif case == "cos 2 rows":
        cos = cos[:2]
    elif case == "cos strided":
        cos = torch.randn(32, 3).bfloat16().t()
    elif case == "sin other shape":
        sin = sin.reshape(-1)
    _raises(k.rotary_, x, cos, sin, match=match)


def _kv_args(T=3, blocks=4, bs=4, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    return [torch.zeros(blocks, bs, H, D), torch.zeros(blocks, bs, H, D), torch.randn(T, H, D, generator=g),
            torch.randn(T, H, D, generator=g), torch.tensor([0, 5, 15])]


@pytest.mark.parametrize("case,match", [
    ("slot past the pool", r"write_kv_: slots\[1\] = 16 is outside the pool's 16 slots"),
    ("negative slot", r"write_kv_: slots\[2\] = -1 is outside the pool's 16 slots"),
    ("fewer slots than rows", r"write_kv_: slots must be \[3\] \(one slot a row of k\), got shape \[2\]"),
    ("slots int32", r"write_kv_: slots must be Long, got Int"),
    ("slots on meta", r"write_kv_: slots must be a CPU tensor"),
    ("k bf16", r"write_kv_: k must have k_cache's dtype Float, got BFloat16"),
    ("k other heads", r"write_kv_: k_cache must end in k's \[kv_heads, head_dim\] = \[1, 8\]"),
    ("v other shape", r"write_kv_: v must have k's shape"),
    ("k_cache strided", r"write_kv_: k_cache must be contiguous"),
    ("k heads strided", r"write_kv_: the heads of a k/v row must be contiguous"),
    ("k 2 dims", r"write_kv_: k must be \[T, kv_heads, head_dim\] \(3 dims\)"),
])
def test_write_kv_rejects(k, case, match):
    kc, vc, kk, vv, slots = _kv_args()
    if case == "slot past the pool":
        slots = torch.tensor([0, 16, 3])
    elif case == "negative slot":
        slots = torch.tensor([0, 1, -1])
    elif case == "fewer slots than rows":
        slots = slots[:2]
    elif case == "slots int32":
        slots = slots.int()
    elif case == "slots on meta":
        slots = _meta(slots)
    elif case == "k bf16":
        kk = kk.bfloat16()
    elif case == "k other heads":
        kk, vv = kk[:, :1], vv[:, :1]
    elif case == "v other shape":
        vv = vv[:2]
    elif case == "k_cache strided":
        kc = _noncontiguous(kc)
    elif case == "k heads strided":
        kk = kk.transpose(1, 2).contiguous().transpose(1, 2)  # strides [16, 1, 2]
    elif case == "k 2 dims":
        kk, vv = kk.reshape(3, -1), vv.reshape(3, -1)
    _raises(k.write_kv_, kc, vc, kk, vv, slots, match=match)
    if case == "slot past the pool":  # nothing was written before the bad slot was found
        assert not kc.any() and not vc.any()


def test_write_kv_writes_strided_rows_at_their_slots(k):
    """Rows of a wider QKV output (row stride > H * D) land at their slots, against index_copy_."""
    kc, vc, _, _, slots = _kv_args()
    qkv = torch.randn(3, 3, 2, 8)
    k.write_kv_(kc, vc, qkv[:, 1], qkv[:, 2], slots)
    want = torch.zeros(16, 2, 8).index_copy_(0, slots, qkv[:, 1])
    assert torch.equal(kc.view(16, 2, 8), want)


@pytest.mark.parametrize("case,match", [
    ("float32", r"silu_and_mul_bf16: gate_up must be BFloat16, got Float"),
    ("on meta", r"silu_and_mul_bf16: gate_up must be a CPU tensor"),
    ("width 48", r"silu_and_mul_bf16: gate_up's width 2I must be a multiple of 32 \(I % 16 == 0\), got 48"),
    ("strided", r"silu_and_mul_bf16: gate_up must be contiguous"),
    ("3 dims", r"silu_and_mul_bf16: gate_up must be \[rows, 2I\] \(2 dims\)"),
])
def test_silu_and_mul_rejects(k, case, match):
    _avx512(k)
    x = torch.randn(4, 64).bfloat16()
    x = {"float32": x.float(), "on meta": _meta(x), "width 48": x[:, :48].contiguous(),
         "strided": torch.randn(64, 4).bfloat16().t(), "3 dims": x[None]}[case]
    _raises(k.silu_and_mul_bf16, x, match=match)


@pytest.mark.parametrize("case,match", [
    ("x int32", r"add_rms_norm_: x must be one of Float, BFloat16, Half, got Int"),
    ("x on meta", r"add_rms_norm_: x must be a CPU tensor"),
    ("weight bf16", r"add_rms_norm_: weight must have x's dtype Float, got BFloat16"),
    ("weight 7", r"add_rms_norm_: weight must hold x's dim = 8 values, got shape \[7\]"),
    ("x strided", r"add_rms_norm_: x must be contiguous"),
    ("dim 0", r"add_rms_norm_: x must be \[..., dim\] with dim >= 1, got shape \[3, 0\]"),
    ("residual other shape", r"add_rms_norm_: residual must have x's shape \[3, 8\], got \[2, 8\]"),
    ("residual half", r"add_rms_norm_: residual must have x's dtype Float, got Half"),
    ("residual strided", r"add_rms_norm_: residual must be contiguous"),
])
def test_add_rms_norm_rejects(k, case, match):
    x, residual, weight = torch.randn(3, 8), None, torch.ones(8)
    if case == "x int32":
        x = x.int()
    elif case == "x on meta":
        x = _meta(x)
    elif case == "weight bf16":
        weight = weight.bfloat16()
    elif case == "weight 7":
        weight = weight[:7]
    elif case == "x strided":
        x = torch.randn(8, 3).t()
    elif case == "dim 0":
        x, weight = x[:, :0], weight[:0]
    elif case == "residual other shape":
        residual = torch.randn(2, 8)
    elif case == "residual half":
        residual = torch.randn(3, 8).half()
    elif case == "residual strided":
        residual = torch.randn(8, 3).t()
    _raises(k.add_rms_norm_, x, residual, weight, 1e-6, match=match)


@pytest.mark.parametrize("case,match", [
    ("x int32", r"dense_gemm: x and w must be both float32 or both bf16, got x Int and w Float"),
    ("w bf16", r"dense_gemm: x and w must be both float32 or both bf16, got x Float and w BFloat16"),
    ("w on meta", r"dense_gemm: w must be a CPU tensor"),
    ("w K 5", r"dense_gemm: w.size\(1\) must be 6 \(x's K\), got 5"),
    ("x 1 dim", r"dense_gemm: x must be \[M, K\] \(2 dims\)"),
])
def test_dense_gemm_rejects(k, case, match):
    _avx512(k)
    x, w = torch.randn(3, 6), torch.randn(5, 6)
    x, w = {"x int32": (x.int(), w), "w bf16": (x, w.bfloat16()), "w on meta": (x, _meta(w)),
            "w K 5": (x, w[:, :5]), "x 1 dim": (x[0], w)}[case]
    _raises(k.dense_gemm, x, w, match=match)


@pytest.mark.parametrize("case,match", [
    ("offsets int32", r"grouped_dense_gemm: offsets must be int64 \[E \+ 1\] = \[3\], got Int of shape \[3\]"),
    ("offsets short", r"grouped_dense_gemm: offsets must be int64 \[E \+ 1\] = \[3\], got Long of shape \[2\]"),
    ("offsets past x", r"grouped_dense_gemm: offsets must run from 0 to the 4 rows of x, got 0 to 9"),
    ("offsets decreasing", r"grouped_dense_gemm: offsets must not decrease, got offsets\[0\] = 0 > offsets\[1\] "
                           r"= -2"),
    ("w 2 dims", r"grouped_dense_gemm: w must be \[E, N, K\] \(3 dims\)"),
    ("w on meta", r"grouped_dense_gemm: w must be a CPU tensor"),
])
def test_grouped_dense_gemm_rejects(k, case, match):
    _avx512(k)
    x, w, off = torch.randn(4, 6), torch.randn(2, 5, 6), torch.tensor([0, 1, 4])
    if case == "offsets int32":
        off = off.int()
    elif case == "offsets short":
        off = off[:2]
    elif case == "offsets past x":
        off = torch.tensor([0, 1, 9])
    elif case == "offsets decreasing":
        off = torch.tensor([0, -2, 4])
    elif case == "w 2 dims":
        w = w[0]
    elif case == "w on meta":
        w = _meta(w)
    _raises(k.grouped_dense_gemm, x, w, off, match=match)


# ----- a build that fails -----

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """cpu_kernels() as in a new process, with an empty kernel cache in tmp_path."""
    import ember.kernels as kmod

    monkeypatch.setattr(kmod, "_module", None)
    monkeypatch.setattr(kmod, "_failed", False)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EMBER_CPU_KERNELS", raising=False)
    monkeypatch.delenv("EMBER_EMULATE_AVX512", raising=False)
    return kmod


COMPILER_OUTPUT = ("Error building extension 'ember_cpu_x': [1/8] c++ -MMD -c quant_gemm.cpp\n"
                   "FAILED: quant_gemm.o\nquant_gemm.cpp:12:10: fatal error: immintrin.h: No such file\n"
                   "compilation terminated.\nninja: build stopped: subcommand failed.")


@pytest.mark.parametrize("error", [RuntimeError(COMPILER_OUTPUT), FileNotFoundError(2, "No such file", "c++"),
                                   OSError("Read-only file system")])
def test_a_failed_build_falls_back_and_says_what_was_lost(fresh_build, monkeypatch, caplog, error):
    import torch.utils.cpp_extension as cpp_extension

    def load(**kw):
        raise error

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level("WARNING", logger="ember"):
        assert fresh_build.cpu_kernels() is None
        assert fresh_build.cpu_kernels() is None  # decided once
    [record] = [r for r in caplog.records if "UNAVAILABLE" in r.getMessage()]
    text = record.getMessage()
    assert record.levelname == "WARNING"
    for part in ("paged decode / prefill attention", "int4 / int8 / w8a8 GEMMs", "decode is about 3x slower",
                 "EMBER_CPU_KERNELS=0", "install a C++ compiler", type(error).__name__):
        assert part in text
    first = str(error).splitlines()[0]
    assert first in text
    log = text.split("full output in ")[1].split("\n")[0]
    with open(log) as f:
        full = f.read()
    assert str(error).splitlines()[-1] in full  # the whole output, past the lines the warning quotes
    if isinstance(error, RuntimeError):
        assert "ninja: build stopped" not in text and "ninja: build stopped" in full


def test_a_library_that_does_not_load_falls_back(fresh_build, monkeypatch, caplog):
    """A finished build's library that no longer loads (an ImportError of ember_cpu_<hash>, not of ember)."""
    import os

    real = fresh_build._load_built

    def broken(build, name):
        os.makedirs(build, exist_ok=True)
        bad = os.path.join(build, f"{name}.so")
        with open(bad, "wb") as f:
            f.write(b"not a library")
        with open(os.path.join(build, fresh_build._READY), "w") as f:
            f.write(bad)
        return real(build, name)

    monkeypatch.setattr(fresh_build, "_load_built", broken)
    with caplog.at_level("WARNING", logger="ember"):
        assert fresh_build.cpu_kernels() is None
    assert any("UNAVAILABLE" in r.getMessage() and "ImportError" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bug", [NameError("name 'sources' is not defined"), TypeError("unsupported operand"),
                                 AttributeError("module 'ember.envs' has no attribute 'x'"),
                                 ModuleNotFoundError("No module named 'ember.cachex'", name="ember.cachex")])
def test_a_bug_in_embers_own_code_propagates(fresh_build, monkeypatch, bug):
    """Not a slow fallback that hides the bug: the error reaches the caller, and the next call tries again."""
    def helper(build, name):
        raise bug

    monkeypatch.setattr(fresh_build, "_load_built", helper)
    with pytest.raises(type(bug)):
        fresh_build.cpu_kernels()
    assert fresh_build._failed is False
