"""Quantized matmuls: a QuantizedTensor re-laid out once for the device's kernel, then ``y = x W^T``.

One *path* a weight, chosen at load by ``select_path`` and run by its class in ``MATMUL_PATHS``:
- ``cpu-int8`` / ``cpu-int4`` / ``cpu-w8a8``: torch's packed CPU ops (``_weight_int8pack_mm``,
  ``_weight_int4pack_mm_for_cpu``, ``_int_mm``; w8a8 with ember's fused quantization and rescale around it). The
  weight-only ops are fast for decode-sized batches and only in bf16 (fp32 inputs run 10-40x slower), so
  activations enter them as bf16 whatever the model's dtype. For big batches
  (prefill chunks) dequantizing the weight once and running one dense matmul is faster: measured for a 1536x576
  weight, 512 rows, bf16: packed int8 7.4 ms, int4 6.9 ms, dequantize + matmul 2.1 ms; at 64 rows the packed ops
  win (0.7 ms vs 0.75 ms; at 1 row 17 us vs 360 us). Only the packed form is kept: the dense path unpacks it.
- ``cuda-int4``: torch's tinygemm (``_convert_weight_to_int4pack`` + ``_weight_int4pack_mm``, sm80+, bf16), every
  batch size (as gpt-fast); ``cuda-int8``: ``_weight_int8pack_mm`` where the installed torch has its CUDA kernel;
  ``cuda-w8a8``: ``torch._int_mm`` (cuBLASLt int8, at least 17 rows: smaller batches are zero-padded).
- ``portable``: dequantize per call (int8 per channel: cast, matmul, scale). Correct on every device.
On CPUs with AVX512-BF16, ember's own kernels (``ember/kernels/quant_gemm.cpp``) take over: int4 at every batch
size, reading torch's pack as it lies with the nibbles made exact bf16 values in registers (3072x576, bf16
activations, 2 threads, 2026-11-25: 1 row 9 us against torch's packed op 25 us, 64 rows 0.28 against 0.65 ms),
and from 128 rows on (batch_invariant=False) through a panel of the block's weights rounded to bf16 (the default
model's four shapes at 2048 rows: 14.6 ms against 18.4 for the exact kernel and 15.1 for oneDNN on the dequantized
weights); where the CPU has AMX, int4 runs on AMX tiles at every row count instead (exact w, invariant); int8 from 5
rows (each thread lays 64 output columns out once as exact integers and runs register-blocked bf16 dot products
against them) and at 1-4 rows, where it dots the weight rows directly (five shapes of the two models, 2 threads,
AMD Zen 5, 2026-11-25, interleaved medians: 1 row 66-73 GB/s against torch's op 30-49, 4 rows 34-42 against 26-31).
Scales are applied to float32 sums, so only int4 prefill batches of the non-invariant kernel round w to bf16.
Batch invariance (``batch_invariant=True``, the default; docs/batch_invariance.md): on CPU each row's result must not
depend on the rows beside it, so a path never switches kernels by row count: ember's kernels run their invariant
variants at every row count, and without them torch's packed ops serve every row count (their rows are independent;
measured on AVX2) instead of switching to a dense matmul at DENSE_MIN_ROWS (that dense matmul, with
batch_invariant=False, runs in float32 where the CPU has no native bf16 matmul). ember's int4 kernel reads its own
64-row pack (``pack_cpu_int4``), which is torch's on AVX512 CPUs; torch's pack follows the CPU (32 rows on AVX2), so
the dense path unpacks with the block found on the machine (``torch_int4_block_rows``).
torch's packed ops check little and some crash on shapes they do not take, so ``select_path`` picks a path only where
its kernel's preconditions hold, at load: ``_weight_int8pack_mm`` only for K % 16 == 0 (other K segfault or return
garbage), ``_weight_int4pack_mm_for_cpu`` only for groups of 32-256, ``torch._int_mm`` only for K >= 2 (K = 1 gives
wrong products); a weight outside them runs ember's kernel (any K; int4 groups a multiple of 4) or the portable
path, so such a model still loads and runs.
The CUDA paths have not yet run on a GPU in this project's sessions, so the first weight of each CUDA path in a
process is checked against the portable result on a random input; a kernel that fails or disagrees is logged
and that path is not used again in the process (its weights run the portable path).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F

from ember import envs
from ember.dtypes import cpu_has_fast_bf16
from ember.kernels import cpu_kernels
from ember.quantization.tensor import QuantizedTensor, quantize_int8_symmetric

logger = logging.getLogger("ember")

DENSE_MIN_ROWS = 128  # from this many rows on, dequantize + one dense matmul beats the packed CPU ops
EMBER_INT4_MIN_ROWS = 1  # ember's int4 kernel beats torch's packed op at every batch size (1 row: 9 vs 25 us)
EMBER_INT8_MIN_ROWS = 5  # from 5 rows the int8 panels beat torch's op (49152x576: 5 rows 1.05 vs 1.7-1.8 ms, 16 rows
#                         1.8 vs 3.6)
EMBER_INT8_ROWS_MAX = 4  # up to 4 rows ember's kernel dots the weight rows as they lie: 1.2-2.5x torch's op (below)
_INT4_BLOCK_N = 64  # ember's CPU int4 pack interleaves 64 output rows; other row counts take the portable path
W4A8_BLOCK = 32  # inputs an int8 activation scale covers in ember's w4a8 kernel (llama.cpp's Q8_0 block)
_INT_MM_MIN_ROWS = 17  # cuBLASLt int8 GEMM through torch._int_mm wants more than 16 rows
# torch's _weight_int8pack_mm (CPU, torch 2.13, AVX512) reads K 16 values at a time with no tail and checks nothing:
# other K crash the process or return garbage (measured: K 12, 36, 70 segfault; K 8, 24 give inf; K 1000 an 8%
# error), so only K % 16 == 0 reaches it (CUDA: the same bound, unverified there).
TORCH_INT8PACK_K_MULTIPLE = 16
TORCH_INT4_GROUPS = (32, 64, 128, 256)  # _weight_int4pack_mm_for_cpu raises at the call for any other group
INT_MM_MIN_K = 2  # torch._int_mm on CPU (torch 2.13) returns wrong products for K = 1, at every row count
_CHECKED: dict[tuple[str, str], bool] = {}  # (path, device) -> whether its self-check passed


@functools.cache
def _ember_gemm():
    """ember's compiled quantized GEMMs, or None where they were not built (no compiler, no AVX512-BF16). Cached:
    ``cpu_kernels`` decides once a process, and a matmul asks at every call."""
    k = cpu_kernels()
    return k if k is not None and k.has_avx512_bf16() else None


def _has_kernel(op: str, key: str) -> bool:
    packet = getattr(torch.ops.aten, op, None)
    return packet is not None and torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), key)


def select_path(method: str, device: torch.device, n: int, k: int, group_size: int) -> str:
    """The fastest path this device and shape allow (``portable`` when none does). A path is only chosen where its
    kernel's preconditions hold for the shape (``_torch_int8pack_ok``, ``_cpu_int4_ok``), so a model whose widths
    torch's packed ops do not take still loads and runs, on the portable path."""
    if device.type == "cpu":
        if method == "int5" and cpu_holds_int5(n, k, group_size):
            return "cpu-int5"
        if method == "int6" and cpu_holds_int6(n, k):
            return "cpu-int6"
        if method == "int4" and _has_kernel("_weight_int4pack_mm_for_cpu", "CPU") and _cpu_int4_ok(n, k, group_size):
            return "cpu-int4"
        if method == "int8" and _has_kernel("_weight_int8pack_mm", "CPU") and (
                _torch_int8pack_ok(k) or _ember_gemm() is not None):  # ember's int8 kernels take any K
            return "cpu-int8"
        if method == "w8a8" and _has_kernel("_int_mm", "CPU") and k >= INT_MM_MIN_K:
            return "cpu-w8a8"
    elif device.type == "cuda":
        if (method == "int4" and _has_kernel("_weight_int4pack_mm", "CUDA")
                and torch.cuda.get_device_capability(device) >= (8, 0) and n % 8 == 0 and k % 32 == 0
                and group_size in (32, 64, 128, 256)):
            return "cuda-int4"
        if method == "int8" and _has_kernel("_weight_int8pack_mm", "CUDA") and _torch_int8pack_ok(k):
            return "cuda-int8"
        if method == "w8a8" and _has_kernel("_int_mm", "CUDA") and n % 8 == 0 and k % 8 == 0:
            return "cuda-w8a8"
    return "portable"


def _torch_int8pack_ok(k: int) -> bool:
    """Whether torch's ``_weight_int8pack_mm`` may be called with this K (TORCH_INT8PACK_K_MULTIPLE)."""
    return k % TORCH_INT8PACK_K_MULTIPLE == 0


def _cpu_int4_ok(n: int, k: int, group_size: int) -> bool:
    """The CPU int4 path's shapes: 64-row blocks, and a group that the kernel it will run takes (ember's: a multiple
    of 4; torch's packed op: TORCH_INT4_GROUPS), dividing K."""
    if n % _INT4_BLOCK_N or group_size <= 0 or k % group_size:
        return False
    return group_size in TORCH_INT4_GROUPS or (_ember_gemm() is not None and group_size % 4 == 0)


def cpu_holds_int5(n: int, k: int, group_size: int) -> bool:
    """Whether a 5-bit weight of this shape runs as it is on this CPU: ember's int4 kernel with the fifth bits
    (built: AVX512-BF16, or emulated). Not where AMX runs the quantized weights: its int4 tiles take no fifth bit,
    and int8 there runs AMX's exact path, far faster from a few rows on than vdpbf16ps. Where this is False the
    loader holds such weights as int8 per row."""
    kernels = _ember_gemm()
    return kernels is not None and not (envs.cpu_amx_enabled() and kernels.has_amx()) and \
        _cpu_int4_ok(n, k, group_size)  # with ember's kernel: 64-row blocks, groups a multiple of 4 dividing K


def cpu_holds_int6(n: int, k: int) -> bool:
    """Whether a 6-bit weight (GGUF Q6_K) of this shape runs as it is on this CPU: ember's int6 kernel built
    (AVX512-BF16 and VBMI, or emulated), 64-row blocks and super-blocks of 256 inputs, and not where AMX runs the
    quantized weights (as ``cpu_holds_int5``). Where this is False the loader holds such weights as int8 per row."""
    kernels = _ember_gemm()
    return kernels is not None and kernels.has_int6() and not (envs.cpu_amx_enabled() and kernels.has_amx()) and \
        n % _INT4_BLOCK_N == 0 and k % 256 == 0


@functools.cache
def torch_int4_block_rows() -> int:
    """The output rows torch's CPU int4 pack (``_convert_weight_to_int4pack_for_cpu``) interleaves on this machine:
    its layout follows the CPU ATen runs on, 64 rows where it runs AVX512 code, 32 with AVX2."""
    q = torch.zeros(64, 2, dtype=torch.int32)
    q[32:] = 1  # rows 32.. share a byte with rows 0.. only in the 64-row layout
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return 64 if int(packed.view(-1)[0]) >> 4 == 1 else 32


def pack_cpu_int4(q: torch.Tensor, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """uint8 values [N, K] -> bytes [N/block, K, block/2] (as uint8 [N, K/2]): row r of a block in byte
    r % (block/2), low nibble for the first half of the block. With block 64 this is torch's AVX512 layout, the one
    ember's int4 kernel reads on every CPU."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n // block, block, k)
    return (b[:, :block // 2] | (b[:, block // 2:] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def unpack_cpu_int4(packed: torch.Tensor, n: int, k: int, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """Invert ``pack_cpu_int4`` (and torch's CPU pack, whose block is ``torch_int4_block_rows()``) -> uint8 [N, K]."""
    p = packed.view(n // block, k, block // 2)
    q = torch.cat([p & 0xF, p >> 4], dim=2)  # [N/block, K, block]
    return q.transpose(1, 2).reshape(n, k)


def _scale_zeros(qt: QuantizedTensor) -> torch.Tensor:
    """Both int4 kernels compute w = (q - 8) * scale + zero, so zero = offset + 8 * scale; bf16 [K/g, N, 2]."""
    zeros = qt.offsets + 8 * qt.scales
    return torch.stack([qt.scales, zeros], dim=-1).transpose(0, 1).contiguous().bfloat16()


KQ_SUPER, KQ_GROUP = 256, 32  # a K-quant super-block's inputs, and its groups' (Q4_K / Q5_K)
_KQ_BYTES = 4 * _INT4_BLOCK_N + 2 * (KQ_SUPER // KQ_GROUP) * _INT4_BLOCK_N  # as ember/kernels/quant_gemm.cpp


def _integer_multiples(values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor | None:
    """values [N, S * 8] as bytes q with q * factor == value exactly (factor per [N, S] repeated over its 8 groups),
    or None where some value is no such multiple."""
    n, groups = values.shape
    per = factors[:, :, None]
    q = (values.view(n, -1, KQ_SUPER // KQ_GROUP) / per).nan_to_num_(0.0).round_()  # 0 / 0: 0; x / 0: no multiple
    if not (q.min() >= 0 and q.max() <= 255 and torch.equal((q * per).view(n, groups), values)):
        return None
    return q.view(n, groups).to(torch.uint8)


def pack_k_scales(qt: QuantizedTensor, block: int = _INT4_BLOCK_N) -> torch.Tensor | None:
    """A Q4_K / Q5_K weight's scales as the file stores them, in the layout ember's int4 kernel reads
    (``KQuantScales``): uint8 [N/block, K/256, 1280], per block of rows and super-block the rows' f16 d
    (``super_scales``), then their f16 e (``super_offsets``, -dmin), then per group of 32 the rows' sc, then their
    m (scale = d sc, offset = e m). 0.625 bits a weight where the bf16 pairs take 1, and exact where they round s and
    the zero to bf16. None where the weight has no such factors (other blocks, another group size, K not a multiple
    of 256, factors that are not f16 values or scales that are not byte multiples of them): the pairs hold it."""
    n, k = qt.shape
    if (qt.super_scales is None or qt.super_offsets is None or qt.offsets is None or qt.group_size != KQ_GROUP
            or k % KQ_SUPER or n % block):
        return None
    d, e = qt.super_scales.float(), qt.super_offsets.float()
    if not (torch.equal(d.half().float(), d) and torch.equal(e.half().float(), e)):
        return None
    sc, m = _integer_multiples(qt.scales.float(), d), _integer_multiples(qt.offsets.float(), e)
    if sc is None or m is None:
        return None
    nb, supers, groups = n // block, k // KQ_SUPER, KQ_SUPER // KQ_GROUP

    def per_super(t: torch.Tensor) -> torch.Tensor:  # [N, S] f16 -> bytes [nb, S, 2 * block]
        return t.half().view(nb, block, supers).transpose(1, 2).contiguous().view(torch.uint8)

    ints = torch.stack([sc.view(nb, block, supers, groups), m.view(nb, block, supers, groups)], dim=-1)
    ints = ints.permute(0, 2, 3, 4, 1).reshape(nb, supers, 2 * groups * block)  # [nb, S, group, sc | m, row]
    return torch.cat([per_super(d), per_super(e), ints], dim=-1).contiguous()


def unpack_k_scales(packed: torch.Tensor, n: int, k: int, block: int = _INT4_BLOCK_N
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert ``pack_k_scales`` -> (scales, offsets), float32 [N, K/32]."""
    nb, supers, groups = n // block, k // KQ_SUPER, KQ_SUPER // KQ_GROUP
    p = packed.view(nb, supers, _KQ_BYTES)

    def factor(at: int) -> torch.Tensor:  # -> [nb, S, 1, block]
        return p[..., at:at + 2 * block].contiguous().view(torch.float16).float().view(nb, supers, 1, block)

    ints = p[..., 4 * block:].reshape(nb, supers, groups, 2, block).float()
    scales, offsets = ints[..., 0, :] * factor(0), ints[..., 1, :] * factor(2 * block)  # [nb, S, group, row]
    return tuple(t.permute(0, 3, 1, 2).reshape(n, k // KQ_GROUP) for t in (scales, offsets))


def pack_x8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] (K a multiple of W4A8_BLOCK) -> what ember's int8-activation kernel reads (``int8_x8_gemm``): the
    weight per 16 rows (zeros past N) with each row's 4 inputs of a step side by side, int8 [ceil(N/16), K/4, 16,
    4], and -128 * each row's sum over each block, int32 [ceil(N/16), K/W4A8_BLOCK, 16] (the kernel multiplies q +
    128 against the signed weight)."""
    n, k = w.shape
    panels = -(-n // 16)
    padded = torch.zeros(panels * 16, k, dtype=torch.int8)
    padded[:n] = w
    wv = padded.view(panels, 16, k // 4, 4).transpose(1, 2).contiguous()
    sums = padded.view(panels, 16, k // W4A8_BLOCK, W4A8_BLOCK).sum(-1, dtype=torch.int32).transpose(1, 2)
    return wv, (-128 * sums).contiguous()


def block_scale_zeros(sz: torch.Tensor, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """[K/g, N, 2] -> [N/block, K/g, block, 2]: ember's int4 kernel reads a block of output rows at a time, and with
    its scales next to each other they stream from memory beside its weights. With row stride N each group's pairs
    were a far read of their own: one row through 28 cold 17920 x 1536 weights, 2 threads, Xeon, 1.71-2.11 ms a
    weight before, 1.42-1.46 after (0.99-1.04 with the kernel's prefetch)."""
    g, n, _ = sz.shape
    return sz.view(g, n // block, block, 2).transpose(0, 1).contiguous()


def _tinygemm_inner_k_tiles(k: int) -> int:
    """tinygemm packs 2, 4 or 8 k-tiles of 16 together and needs K divisible by that span: the widest that fits."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


_EXACT_K = 1024  # int8 products (|p| <= 128 * 128) summed over at most 1024 k: |sum| <= 2**24, exact in float32


@functools.cache
def cpu_has_int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8), which oneDNN's int8
    GEMM (``torch._int_mm``) needs to be fast: without them it ran 20-30x slower than a float32 matmul of the same
    shape (AVX2 Zen 3, 2 threads, 128 x 576 x 1536: 59 ms against 2.8). A fact of the machine, asked once."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux: trust oneDNN
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


@functools.cache
def _cpu_w8a8_fused() -> bool:
    """ember's fused w8a8 kernel where its GEMM is fast, and where the AVX-512 kernels are emulated (their tests);
    decided once a process, not at every matmul."""
    return cpu_has_int8_dot() or envs.emulate_avx512()


def int8_mm_exact_float(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 [rows, K] x int8 [N, K]^T as float32, the exact integer products (``torch._int_mm``'s) to the bit: float32
    matmuls over slices of at most _EXACT_K columns sum exact integers below 2**24 (so any order gives the same
    result, and rows never depend on the rows beside them), and the slices add as int32."""
    k = xq.shape[1]
    if k <= _EXACT_K:
        return xq.float() @ w.float().t()
    acc = torch.zeros(xq.shape[0], w.shape[0], dtype=torch.int32, device=xq.device)
    for k0 in range(0, k, _EXACT_K):
        acc += (xq[:, k0:k0 + _EXACT_K].float() @ w[:, k0:k0 + _EXACT_K].float().t()).to(torch.int32)
    return acc.float()


def _w8a8(x: torch.Tensor, n: int, k: int, int_mm: Callable[[torch.Tensor], torch.Tensor],
          scales: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token int8 activations x int8 per-channel weights: ``int_mm`` accumulates the int8 products
    (as float), then one float rescale by the token's and the channel's scales."""
    xq, xs = quantize_int8_symmetric(x.reshape(-1, k), dim=1)
    return (int_mm(xq) * xs * scales).to(x.dtype).view(*x.shape[:-1], n)


class MatmulPath:
    """One way to run ``y = x W^T``: ``prepare`` lays the weight out for its kernel once, ``matmul`` runs it.

    ``w`` and ``s`` are the kernel's weight and scales; ``checked_at_load`` marks the paths whose first weight in a
    process is checked against the portable result (``QuantizedMatmul._self_check``). ``invariant``: the CPU paths
    keep a row's result independent of the rows beside it (one kernel at every row count), else they switch to the
    fastest kernel for the row count. ``int8_x``: whether the weight multiplies int8-quantized activations: asked
    for (``EngineConfig.int8_activations``) on a path with such a kernel (``takes_int8_x``), which ``prepare`` may
    still turn down for the machine or the weight."""

    __slots__ = ("method", "n", "k", "group_size", "w", "s", "invariant", "int8_x")
    name: ClassVar[str]
    checked_at_load: ClassVar[bool] = False
    takes_int8_x: ClassVar[bool] = False

    def __init__(self, method: str, n: int, k: int, group_size: int, invariant: bool = True,
                 int8_x: bool = False) -> None:
        self.method, self.n, self.k, self.group_size = method, n, k, group_size
        self.invariant, self.int8_x = invariant, int8_x and self.takes_int8_x
        self.w: torch.Tensor | None = None
        self.s: torch.Tensor | None = None

    def prepare(self, qt: QuantizedTensor) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, K] -> float32 [rows, N]: an LM head's product. Paths whose kernel writes float32 override it, so
        that the logits are not rounded to bf16 (ties a greedy step breaks by token id)."""
        return self.matmul(x).float()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] as this path holds it, in dtype."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What this weight holds in memory."""
        return [t for t in (self.w, self.s) if t is not None]


class PortablePath(MatmulPath):
    """Dequantize per call; correct on every device. Keeps the QuantizedTensor as it is."""

    __slots__ = ("qt",)
    name = "portable"

    def prepare(self, qt: QuantizedTensor) -> None:
        self.qt = qt

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        qt = self.qt
        if self.method == "w8a8":
            return _w8a8(x, self.n, self.k, self._float_int_mm, qt.scales.view(-1))
        if qt.kind == "int8" and qt.group_size == self.k:  # per channel: no float copy of the scaled weight
            return F.linear(x, qt.data.to(x.dtype)) * qt.scales.view(-1).to(x.dtype)
        return F.linear(x, qt.dequantize(x.dtype))

    def _float_int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        """No int8 GEMM here: the same arithmetic in float (exact while the int32 sums stay below 2**24)."""
        return xq.float() @ self.qt.data.float().t()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qt.dequantize(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qt.data, self.qt.scales, self.qt.offsets) if t is not None]


class _WeightOnlyPath(MatmulPath):
    """int8 / int4 weights through one of torch's packed ops, which take bf16 activations."""

    __slots__ = ()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        xb = x.reshape(rows, self.k).to(torch.bfloat16)
        return self.packed_mm(xb).to(x.dtype).view(*x.shape[:-1], self.n)

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        """bf16 [rows, K] -> bf16 [rows, N] through the kernel."""
        raise NotImplementedError


class _CpuWeightOnly(_WeightOnlyPath):
    """ember's kernel where it was built: batch invariant, at every row count; otherwise (batch_invariant=False)
    from ``ember_min_rows`` rows on and up to ``ember_max_small_rows``. Without it: torch's packed op (its rows do
    not depend on each other), and when not invariant, from DENSE_MIN_ROWS one dense matmul of the dequantized
    weight (figures in the module docstring)."""

    __slots__ = ()
    ember_min_rows: ClassVar[int]
    ember_max_small_rows: ClassVar[int] = 0  # batches this small take ember's kernel too

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        ember_rows = self.invariant or rows >= self.ember_min_rows or rows <= self.ember_max_small_rows
        if ember_rows and (kernels := _ember_gemm()) is not None:
            if x.dim() == 2 and x.dtype is torch.bfloat16:  # the model's case: no reshapes or casts to dispatch
                return self.ember_mm(kernels, x)
            y = self.ember_mm(kernels, x.reshape(rows, self.k).to(torch.bfloat16))
            return y.to(x.dtype).view(*x.shape[:-1], self.n)
        if rows >= DENSE_MIN_ROWS and not self.invariant:
            dtype = x.dtype if x.dtype == torch.float32 or cpu_has_fast_bf16() else torch.float32
            return F.linear(x.to(dtype), self.dequantized(dtype)).to(x.dtype)
        return super().matmul(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.float_logits() and (kernels := _ember_gemm()) is not None:
            return self.ember_mm(kernels, x.to(torch.bfloat16), float_out=True)  # the kernels take bf16 rows
        return super().logits(x)

    def float_logits(self) -> bool:
        """Whether ember_mm runs every row count here and takes ``float_out`` (float32 logits)."""
        return False

    def ember_mm(self, kernels, xb: torch.Tensor) -> torch.Tensor:
        """bf16 [rows, K] -> bf16 [rows, N] through ember's kernel (float32 with ``float_out`` where
        ``float_logits``)."""
        raise NotImplementedError


class _Int8PackPath(_WeightOnlyPath):
    """``_weight_int8pack_mm``: int8 [N, K] and one scale a row in the activations' dtype."""

    __slots__ = ()

    def prepare(self, qt: QuantizedTensor) -> None:
        self.w, self.s = qt.data.contiguous(), qt.scales.view(-1).bfloat16()  # the op's scale dtype is x's

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        if not _torch_int8pack_ok(self.k):  # select_path keeps such weights off this op; it would crash the process
            raise RuntimeError(f"_weight_int8pack_mm cannot take K={self.k} (a multiple of "
                               f"{TORCH_INT8PACK_K_MULTIPLE} only)")
        return torch.ops.aten._weight_int8pack_mm(xb, self.w, self.s)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.w.to(dtype) * self.s.to(dtype)[:, None]


class CpuInt8Path(_CpuWeightOnly, _Int8PackPath):
    """``x8``: the weight as ``pack_x8`` lays it out, where the int8 activations run (a second copy of the int8
    weight, beside the row layout the embedding lookups and the other paths read)."""

    __slots__ = ("s32", "row_sums", "x8")
    name = "cpu-int8"
    takes_int8_x = True
    ember_min_rows = EMBER_INT8_MIN_ROWS
    ember_max_small_rows = EMBER_INT8_ROWS_MAX

    def prepare(self, qt: QuantizedTensor) -> None:
        super().prepare(qt)
        self.s32 = qt.scales.view(-1).float()  # ember's kernel scales the float sums
        # Where the CPU has AMX: x in exact integer parts against the int8 weight (int8_exact_gemm: vpdpbusd for a
        # few rows, integer tiles for more), the exact product at every row count, so batch invariant by itself;
        # one row 1.3-1.5x faster than the AVX512 path, 16 to 256 rows 3-7x (docs/quantization.md). It needs the
        # weight's row sums.
        self.row_sums = None
        if (kernels := _ember_gemm()) is not None and envs.cpu_amx_enabled() and kernels.has_amx() \
                and self.k < 65536:
            self.row_sums = self.w.sum(1, dtype=torch.int32)
        # int8 activations per 32 inputs (w8a8_blocks.cpp, VNNI; invariant at every row count) where asked for and
        # the exact AMX path does not run
        self.int8_x = (self.int8_x and self.row_sums is None and kernels is not None and kernels.has_w4a8()
                       and self.k % W4A8_BLOCK == 0)
        self.x8 = pack_x8(self.w) if self.int8_x else None

    def ember_mm(self, kernels, xb: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        if self.x8 is not None:
            y = kernels.int8_x8_gemm(xb, *self.x8, self.s32)
            return y.float() if float_out else y
        if self.row_sums is not None:
            return kernels.int8_exact_gemm(xb, self.w, self.row_sums, self.s32, float_out)
        if not self.invariant and xb.shape[0] > EMBER_INT8_ROWS_MAX and (self.n % _INT4_BLOCK_N or self.k % 2):
            # no 64-row panels for this shape: torch's op where it takes K, else the invariant kernel
            y = self.packed_mm(xb) if _torch_int8pack_ok(self.k) else kernels.int8_gemm(xb, self.w, self.s32)
            return y.float() if float_out else y
        return kernels.int8_gemm(xb, self.w, self.s32, self.invariant, float_out)

    def float_logits(self) -> bool:
        # AMX's exact product whether or not the engine is batch invariant: exact, and the fastest int8 path there
        return self.invariant or self.row_sums is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*super().tensors(), self.s32, self.row_sums, *(self.x8 or ())) if t is not None]


class CudaInt8Path(_Int8PackPath):
    __slots__ = ()
    name = "cuda-int8"
    checked_at_load = True


class CpuInt4Path(_CpuWeightOnly):
    """The packed form is the only copy kept: ember's 64-row pack where ember's kernel runs (it reads the pack as it
    lies), else torch's pack for ``_weight_int4pack_mm_for_cpu``, whose layout follows the CPU (``block``: the rows
    it interleaves); the dense path unpacks either."""

    __slots__ = ("block", "amx")
    name = "cpu-int4"
    takes_int8_x = True
    ember_min_rows = EMBER_INT4_MIN_ROWS

    def ember_mm(self, kernels, xb: torch.Tensor) -> torch.Tensor:
        return kernels.int4_gemm(xb, self.w, self.s, self.group_size, self.invariant, self.amx, None, self.int8_x)

    def prepare(self, qt: QuantizedTensor) -> None:
        self.amx = False
        if (kernels := _ember_gemm()) is not None:
            # AMX tiles at every row count where the CPU has them (a row's result does not depend on the rows
            # beside it, so the weight stays batch invariant): 16 to 512 rows 3.3-4.8x faster, one row from memory
            # 9% slower (docs/quantization.md); it rounds otherwise than the AVX512 path, more exactly
            self.amx = envs.cpu_amx_enabled() and kernels.has_amx()
            # int8 activations (w4a8.cpp, VNNI; invariant at every row count) where asked for and AMX does not run
            self.int8_x = (self.int8_x and not self.amx and kernels.has_w4a8()
                           and self.group_size % W4A8_BLOCK == 0)
            self.block = _INT4_BLOCK_N
            self.w, self.s = pack_cpu_int4(qt.unpacked(), self.block), _cpu_int4_scales(qt, self.amx or self.int8_x)
        else:
            self.int8_x = False
            self.block = torch_int4_block_rows()
            self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.unpacked().to(torch.int32), 1)
            self.s = _scale_zeros(qt)

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        if self.group_size not in TORCH_INT4_GROUPS:  # select_path keeps such weights on ember's kernel
            raise RuntimeError(f"_weight_int4pack_mm_for_cpu cannot take groups of {self.group_size} (one of "
                               f"{TORCH_INT4_GROUPS})")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.w, self.group_size, self.s)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.group_size
        q = self.values().float().view(self.n, self.k // g, g)
        if self.s.dtype == torch.uint8:  # K-quant scales as stored
            scale, offset = unpack_k_scales(self.s, self.n, self.k, self.block)
            return (q * scale[..., None] + offset[..., None]).view(self.n, self.k).to(dtype)
        sz = self.s.float()  # [G, N, 2], or blocked for ember's kernel
        if sz.dim() == 4:
            sz = sz.transpose(0, 1).reshape(-1, self.n, 2)
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        return ((q - 8) * scale + zero).view(self.n, self.k).to(dtype)

    def values(self) -> torch.Tensor:
        """The stored integers as uint8 [N, K]."""
        return unpack_cpu_int4(self.w, self.n, self.k, self.block)


def _cpu_int4_scales(qt: QuantizedTensor, pairs_only: bool) -> torch.Tensor:
    """What ember's int4 kernel reads beside the values: a K-quant's scales as stored (``pack_k_scales``) where the
    weight has them and the AVX512-BF16 kernel runs it, else bf16 (scale, zero) pairs (AMX and int8 activations
    take only those). Their speeds: docs/quantization.md."""
    ks = None if pairs_only else pack_k_scales(qt)
    return ks if ks is not None else block_scale_zeros(_scale_zeros(qt))


def pack_cpu_int5_high(q: torch.Tensor, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """The fifth bits of uint8 values [N, K] (0..31) in the order ember's int4 kernel adds them (``int5_high``):
    per 64-row block and pair of inputs (k, k + 1), four 32-bit masks, mask j bit 2c + h for row 16j + c, input
    k + h; uint8 [N * K / 8]."""
    n, k = q.shape
    bits = (q >> 4 & 1).view(n // block, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4)  # [block, k pair, j, c, h]
    bits = bits.reshape(-1, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)  # bit 8i + t: byte i, bit t
    return bits.sum(-1).to(torch.uint8)


def unpack_cpu_int5_high(high: torch.Tensor, n: int, k: int, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """Invert ``pack_cpu_int5_high`` -> the fifth bits as uint8 [N, K] (0 or 1)."""
    bits = (high.view(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.view(n // block, k // 2, 4, 16, 2).permute(0, 2, 3, 1, 4).reshape(n, k)


class CpuInt5Path(CpuInt4Path):
    """5-bit weights (GGUF Q5_0 / Q5_1 / Q5_K, as int5): ember's int4 pack of the low four bits plus a plane of the
    fifth, 6 bits a weight (with the group's scale pair) where int8 reads 8, through the same kernel and its
    batch-invariant order. Only where ``cpu_holds_int5``: no torch op takes it."""

    __slots__ = ("high",)
    name = "cpu-int5"
    takes_int8_x = False  # w4a8.cpp takes no fifth bits

    def prepare(self, qt: QuantizedTensor) -> None:
        self.amx, self.block = False, _INT4_BLOCK_N
        q = qt.unpacked()
        self.w, self.s = pack_cpu_int4(q & 0xF, self.block), _cpu_int4_scales(qt, False)
        self.high = pack_cpu_int5_high(q, self.block)

    def ember_mm(self, kernels, xb: torch.Tensor) -> torch.Tensor:
        return kernels.int4_gemm(xb, self.w, self.s, self.group_size, self.invariant, False, self.high)

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("5-bit weights run on ember's CPU kernel only (cpu_holds_int5)")

    def values(self) -> torch.Tensor:
        return super().values() | unpack_cpu_int5_high(self.high, self.n, self.k, self.block) << 4

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.s, self.high]


_INT6_PAIR_BYTES, _INT6_SUPER_BYTES = 96, 64 * 4 + 16 * 64 + 128 * 96  # as ember/kernels/int6_gemm.cpp
_INT6_ROWS = 256  # ids a cpu_int6_rows pass


def pack_cpu_int6(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, block: int = _INT4_BLOCK_N) -> torch.Tensor:
    """Values uint8 [N, K] (0..63), their int8 scales [N, K / 16] and float32 d [N, K / 256] -> ember's int6 pack,
    uint8 [N / block, K / 256, super-block bytes]: per block of rows and super-block of 256 inputs the block's d,
    its sc [16, block], then per pair of inputs (k, k + 1) 96 bytes: the values of columns 2t, 2t + 1 of each 16
    (j: columns 16j..) at both inputs, four 6-bit values in the 24 bits at byte 24j + 3t (value i: column
    16j + 2t + i // 2, input k + i % 2)."""
    n, k = q.shape
    nb, supers = n // block, k // 256
    v = q.to(torch.int32).view(nb, 4, 8, 2, k // 2, 2).permute(0, 4, 1, 2, 3, 5).reshape(nb, k // 2, 32, 4)
    word = v[..., 0] | v[..., 1] << 6 | v[..., 2] << 12 | v[..., 3] << 18
    body = torch.stack([word & 0xFF, word >> 8 & 0xFF, word >> 16], dim=-1).to(torch.uint8)
    body = body.view(nb, supers, 128 * _INT6_PAIR_BYTES)
    ds = d.to(torch.float32).view(nb, block, supers).transpose(1, 2).contiguous().view(torch.uint8)
    scs = sc.to(torch.int8).view(nb, block, supers, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return torch.cat([ds.view(nb, supers, -1), scs.view(nb, supers, -1), body], dim=-1).contiguous()


def unpack_cpu_int6(packed: torch.Tensor, n: int, k: int, block: int = _INT4_BLOCK_N
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Invert ``pack_cpu_int6`` -> (values uint8 [N, K], sc int8 [N, K / 16], d float32 [N, K / 256])."""
    nb, supers = n // block, k // 256
    p = packed.view(nb, supers, _INT6_SUPER_BYTES)
    d = p[..., :256].contiguous().view(torch.float32).view(nb, supers, block).transpose(1, 2).reshape(n, supers)
    sc = p[..., 256:1280].contiguous().view(torch.int8).view(nb, supers, 16, block).permute(0, 3, 1, 2)
    b = p[..., 1280:].reshape(nb, k // 2, 32, 3).to(torch.int32)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    v = torch.stack([word >> (6 * i) & 63 for i in range(4)], dim=-1)  # [nb, kp, 32, 4]
    q = v.view(nb, k // 2, 4, 8, 2, 2).permute(0, 2, 3, 4, 1, 5).reshape(n, k).to(torch.uint8)
    return q, sc.reshape(n, k // 16), d


def cpu_int6_rows(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int, block: int = _INT4_BLOCK_N
                  ) -> torch.Tensor:
    """Rows ``ids`` of an int6 pack's weight, float32 [len(ids), K], read from the pack where they lie (an embedding
    lookup of a table the LM head holds in this layout: no second copy of it), _INT6_ROWS ids at a time so that the
    index temporaries stay small whatever the prompt."""
    if len(ids) > _INT6_ROWS:
        return torch.cat([cpu_int6_rows(packed, ids[i:i + _INT6_ROWS], n, k, block)
                          for i in range(0, len(ids), _INT6_ROWS)])
    supers = k // 256
    flat = packed.view(-1)
    nb, c = (ids // block).view(-1, 1, 1), (ids % block).view(-1, 1, 1)
    base = (nb * supers + torch.arange(supers).view(1, -1, 1)) * _INT6_SUPER_BYTES  # [T, S, 1]
    d = flat[base + 4 * c + torch.arange(4)].contiguous().view(torch.float32)  # [T, S, 1]
    sc = flat[base + 256 + 64 * torch.arange(16) + c].view(torch.int8).float()  # [T, S, 16]
    at = base + 1280 + _INT6_PAIR_BYTES * torch.arange(128) + 24 * (c // 16) + 3 * (c % 16 // 2)  # [T, S, 128]
    b = flat[at[..., None] + torch.arange(3)].to(torch.int32)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    first = (12 * (c % 2)).to(torch.int32)  # values 2 (c % 2) and 2 (c % 2) + 1: inputs 2 kp, 2 kp + 1 of column c
    q = torch.stack([word >> first & 63, word >> (first + 6) & 63], dim=-1).view(len(ids), supers, 16, 16)
    return ((q.float() - 32) * (sc * d)[..., None]).view(len(ids), k)


class CpuInt6Path(_CpuWeightOnly):
    """6-bit weights (GGUF Q6_K, as int6) through ember's int6 kernel: one stream a 64-row block, 6.625 bits a weight
    where int8 reads 8, each scale kept as the file's int8 sc times its d (so w is exactly the file's value). Only
    where ``cpu_holds_int6``: no torch op takes it."""

    __slots__ = ()
    name = "cpu-int6"
    ember_min_rows = 1

    def prepare(self, qt: QuantizedTensor) -> None:
        if qt.super_scales is None:
            raise ValueError("cpu-int6 needs the weight's super_scales (GGUF Q6_K's d): from_gguf gives them")
        d = qt.super_scales.float()
        per = d.repeat_interleave(16, dim=1)
        sc = torch.where(per == 0, 0.0, qt.scales / torch.where(per == 0, 1.0, per)).round()
        if not torch.equal(sc * per, qt.scales) or sc.min() < -128 or sc.max() > 127:
            raise ValueError("cpu-int6: the weight's scales are not int8 multiples of its super_scales")
        sc = sc.to(torch.int8)
        step = _INT4_BLOCK_N * 64  # rows a pack call: its int32 temporaries stay small (a 151936-row LM head)
        self.w = torch.cat([pack_cpu_int6(qt.data[i:i + step], sc[i:i + step], d[i:i + step])
                            for i in range(0, self.n, step)])

    def float_logits(self) -> bool:
        return self.invariant

    def ember_mm(self, kernels, xb: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        return kernels.int6_gemm(xb, self.w, self.invariant, float_out)

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("6-bit weights run on ember's CPU kernel only (cpu_holds_int6)")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32 (``cpu_int6_rows``)."""
        return cpu_int6_rows(self.w, ids, self.n, self.k)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        q, sc, d = unpack_cpu_int6(self.w, self.n, self.k)
        scale = sc.float() * d.repeat_interleave(16, dim=1)
        return ((q.float() - 32).view(self.n, -1, 16) * scale[..., None]).view(self.n, self.k).to(dtype)


class CudaInt4Path(_WeightOnlyPath):
    """tinygemm (``_weight_int4pack_mm``), every batch size."""

    __slots__ = ()
    name = "cuda-int4"
    checked_at_load = True

    def prepare(self, qt: QuantizedTensor) -> None:
        q = qt.unpacked()
        hi_first = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()  # CUDA's input order: element 2i high
        self.w = torch.ops.aten._convert_weight_to_int4pack(hi_first, _tinygemm_inner_k_tiles(self.k))
        self.s = _scale_zeros(qt)

    def packed_mm(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(xb, self.w, self.group_size, self.s)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """tinygemm's layout is opaque: the identity multiplied through it."""
        eye = torch.eye(self.k, device=self.w.device, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm(eye, self.w, self.group_size, self.s).t().to(dtype)


class _W8A8Path(MatmulPath):
    """``torch._int_mm`` on int8 activations (quantized per token at each call) and int8 weights held [N, K]
    (row-major, one scale a row), passed to the GEMM as their [K, N] transposed view."""

    __slots__ = ()

    def prepare(self, qt: QuantizedTensor) -> None:
        self.w, self.s = qt.data.contiguous(), qt.scales.view(-1).float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _w8a8(x, self.n, self.k, self.int_mm, self.s)

    def int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        """int8 [rows, K] -> the int32 products as float [rows, N]."""
        return torch._int_mm(xq, self.w.t()).float()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.w.to(dtype) * self.s.to(dtype)[:, None]


class CpuW8A8Path(_W8A8Path):
    """oneDNN reads the transposed view as fast as a [K, N] copy; with ember's kernels built, the per-token
    quantization and the rescale are fused around the GEMM (``w8a8_linear``, the same arithmetic to the bit). A CPU
    without int8 dot products takes the same products from float32 matmuls instead (``int8_mm_exact_float``)."""

    __slots__ = ()
    name = "cpu-w8a8"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels()
        if kernels is None or x.dtype not in (torch.bfloat16, torch.float32) or not _cpu_w8a8_fused():
            return super().matmul(x)
        if x.dim() == 2:
            return kernels.w8a8_linear(x, self.w, self.s)
        return kernels.w8a8_linear(x.reshape(-1, self.k), self.w, self.s).view(*x.shape[:-1], self.n)

    def int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        return super().int_mm(xq) if cpu_has_int8_dot() else int8_mm_exact_float(xq, self.w)


class CudaW8A8Path(_W8A8Path):
    """cuBLASLt int8 GEMM (the transposed view is the column-major [K, N] it wants): batches under
    _INT_MM_MIN_ROWS rows are zero-padded up to it."""

    __slots__ = ()
    name = "cuda-w8a8"
    checked_at_load = True

    def int_mm(self, xq: torch.Tensor) -> torch.Tensor:
        rows = xq.shape[0]
        if rows < _INT_MM_MIN_ROWS:
            xq = F.pad(xq, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
        return super().int_mm(xq)[:rows]


MATMUL_PATHS: dict[str, type[MatmulPath]] = {p.name: p for p in (
    CpuInt8Path, CpuInt4Path, CpuInt5Path, CpuInt6Path, CpuW8A8Path, CudaInt4Path, CudaInt8Path, CudaW8A8Path,
    PortablePath)}


class QuantizedMatmul:
    """A weight prepared for ``method`` ('int8' | 'int4' | 'int5' | 'int6' | 'w8a8') on its tensors' device: ``impl``
    is the path (a ``MatmulPath``) chosen once here, ``path`` its name; ``batch_invariant`` and
    ``int8_activations`` as ``EngineConfig``'s (the latter asks, ``int8_x`` says whether this weight's path does)."""

    __slots__ = ("method", "n", "k", "group_size", "impl", "batch_invariant", "int8_activations")

    def __init__(self, method: str, qt: QuantizedTensor, path: str | None = None,
                 batch_invariant: bool = True, int8_activations: bool = False) -> None:
        self.method = method
        self.batch_invariant, self.int8_activations = batch_invariant, int8_activations
        self.n, self.k = qt.shape
        self.group_size = qt.group_size
        if method in ("int5", "int6") and qt.kind != method:
            raise ValueError(f"{method} matmul needs an {method} weight (GGUF's {method[-1]}-bit blocks), got "
                             f"{qt.kind}")
        if method not in ("int4", "int5", "int6") and (qt.kind != "int8" or qt.group_size != self.k):
            raise ValueError(f"{method} matmul needs an int8 weight with one scale per output channel, got "
                             f"{qt.kind} in groups of {qt.group_size} (requantize it first)")
        device = qt.data.device
        self.impl = self._build(path or select_path(method, device, self.n, self.k, self.group_size), qt)
        if self.impl.checked_at_load and device.type == "cuda" and not self._self_check(qt, device):
            self.impl = self._build(PortablePath.name, qt)

    def _build(self, path: str, qt: QuantizedTensor) -> MatmulPath:
        if path not in MATMUL_PATHS:
            raise ValueError(f"quantized matmul path {path!r} is unknown: use one of {tuple(MATMUL_PATHS)}")
        impl = MATMUL_PATHS[path](self.method, self.n, self.k, self.group_size, self.batch_invariant,
                                  self.int8_activations)
        impl.prepare(qt)
        return impl

    @property
    def path(self) -> str:
        return self.impl.name

    @property
    def int8_x(self) -> bool:
        """Whether this weight multiplies int8-quantized activations (its path has such a kernel and runs it)."""
        return self.impl.int8_x

    def _self_check(self, qt: QuantizedTensor, device: torch.device) -> bool:
        """Once per path and device in a process: the kernel against the portable result on a random input."""
        key = (self.path, str(device))
        if key not in _CHECKED:
            gen = torch.Generator(device=device).manual_seed(0)  # the global RNG stays as the user seeded it
            x = torch.randn(3, self.k, device=device, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), qt.dequantize(torch.float32))
            try:
                y = self(x).float()
                err = ((y - ref).norm() / ref.norm().clamp(min=1e-6)).item()
                ok, why = err < 0.05, f"relative error {err:.3g}"
            except RuntimeError as e:  # a build or GPU without the kernel
                ok, why = False, str(e).splitlines()[0]
            (logger.info if ok else logger.warning)(
                "quantized matmul %s on %s: %s (%s)", self.path, device,
                "self-check passed" if ok else "self-check FAILED, using the portable path", why)
            _CHECKED[key] = ok
        return _CHECKED[key]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.impl.dequantized(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight in float32, read from the path's layout (cpu-int6: an embedding lookup)."""
        return self.impl.rows(ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.matmul(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """An LM head's product, float32 [rows, N] (not rounded to bf16 where the path's kernel writes float32)."""
        return self.impl.logits(x)

    def tensors(self) -> list[torch.Tensor]:
        """What this weight holds in memory."""
        return self.impl.tensors()
