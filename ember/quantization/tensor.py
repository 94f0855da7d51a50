"""The quantized weight layout ember stores and loads, whatever the source (a float checkpoint, GGUF blocks, an
.asparam file), and the functions that make it.

A weight ``[N, K]`` is quantized along K (the input), in groups of ``group_size`` (``K`` for one scale per output
channel), so rows can be sliced and stacked freely (fused QKV and gate/up projections load their parts as rows).
- int8: ``data`` int8 ``[N, K]``; ``w = data * scale``;
- int4: ``data`` uint8 ``[N, K / 2]``, two values 0..15 a byte, element ``2i`` in the low nibble;
  ``w = q * scale + offset``. An integer zero point z is the offset ``-z * scale``; GGUF Q4_1's ``d * q + m``,
  Q4_0's ``d * (q - 8)`` and Q4_K's ``d * sc * q - dmin * m`` (per 32 values) are the same form, so those blocks load
  exactly.
- int5: ``data`` uint8 ``[N, K]``, values 0..31, one a byte (only as loaded: the CPU kernel's layout holds 6 bits a
  weight); ``w = q * scale + offset`` as int4, which GGUF Q5_0 (``d * (q - 16)``), Q5_1 and Q5_K are.
- int6: ``data`` uint8 ``[N, K]``, values 0..63, in groups of 16 with ``offset = -32 * scale``: GGUF Q6_K's
  ``d * sc * (q - 32)``, its scales the exact float32 products of an f16 ``d`` a 256 values (``super_scales``
  ``[N, K / 256]``) and an int8 ``sc`` a 16, which the CPU kernel's layout holds as they were (6.6 bits a weight).
``scales`` and ``offsets`` are float32 ``[N, K / group_size]``. GGUF Q4_K / Q5_K weights also keep their
super-blocks' factors (``super_scales`` d, ``super_offsets`` -dmin, ``[N, K / 256]``), of which the scales and offsets
are 6-bit integer multiples: the CPU kernel holds them so, at 4.625 bits a weight where (scale, zero) pairs take 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("int8", "int4", "int5", "int6")


@dataclass(slots=True)
class QuantizedTensor:
    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    # the factor a super-block of 256 inputs has its scales as integer multiples of: int6 (Q6_K), Q4_K / Q5_K's d
    super_scales: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None  # the same for the offsets: Q4_K / Q5_K's -dmin

    def _map(self, fn) -> "QuantizedTensor":
        """The same layout with fn applied to each tensor it holds."""
        keep = lambda t: None if t is None else fn(t)  # noqa: E731
        return QuantizedTensor(self.kind, fn(self.data), fn(self.scales), keep(self.offsets), self.group_size,
                               keep(self.super_scales), keep(self.super_offsets))

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return n, k * 2 if self.kind == "int4" else k

    def unpacked(self) -> torch.Tensor:
        """The int4 values as uint8 [N, K] (int8, int5 and int6 data as they are)."""
        if self.kind != "int4":
            return self.data
        return torch.stack([self.data & 0xF, self.data >> 4], dim=-1).view(self.data.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.unpacked().float().view(n, k // g, g)
        w = q * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The same rows picked by index (undoing a row permutation)."""
        return self._map(lambda t: t.index_select(0, index))

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        return self._map(lambda t: t.to(device))

    def nbytes(self) -> int:
        held = (self.data, self.scales, self.offsets, self.super_scales, self.super_offsets)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row blocks of one layout stacked into one weight (the parts of a fused projection)."""
    if len(parts) == 1:
        return parts[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    # a super-block factor kept only where every part has it (a part without one holds its scales as they are)
    supers = lambda ts: None if any(t is None for t in ts) else torch.cat(ts)  # noqa: E731
    first = parts[0]
    return QuantizedTensor(first.kind, cat([p.data for p in parts]), cat([p.scales for p in parts]),
                           cat([p.offsets for p in parts]), first.group_size, supers([p.super_scales for p in parts]),
                           supers([p.super_offsets for p in parts]))


def quantize_int8_symmetric(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 along dim, computed in float32: (q int8, scale float32 with dim kept as 1), x ~ q * scale.

    The one quantizer of int8 weights (per output channel), w8a8 activations (per token) and int8 KV entries:
    values -127..127 so the range is symmetric; the scale's floor keeps an all-zero slice at exact zeros."""
    x = x.float()
    scale = (x.abs().amax(dim=dim, keepdim=True) / 127).clamp(min=1e-10)
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 with one scale per output channel (row)."""
    data, scale = quantize_int8_symmetric(w, dim=1)
    return QuantizedTensor("int8", data.contiguous(), scale.contiguous(), None, w.shape[1])


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Asymmetric uint4 in groups of group_size along the input, with integer zero points (min-max, round to
    nearest)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 group_size={group_size} does not divide the input size {k} of a {n}x{k} weight")
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedTensor("int4", pack_int4(q), scale.contiguous(), (-zero * scale).contiguous(), group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 -> uint8 [N, K / 2], element 2i in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


# rows are requantized in chunks of about this many values, so the float32 temporaries stay in cache instead of
# touching fresh pages: the default model's 49152 x 576 Q8_0 table to per-row int8 took 204 ms whole, 15-23 ms so
_CHUNK_VALUES = 1 << 19


def requantize(qt: QuantizedTensor | torch.Tensor, kind: str, group_size: int) -> QuantizedTensor:
    """qt in the layout a layer wants: as it is when it already matches, else through float32 (by row chunks)."""
    if isinstance(qt, QuantizedTensor) and qt.kind == kind and qt.group_size == group_size:
        return qt
    n, k = qt.shape
    step = max(1, _CHUNK_VALUES // k)
    if n > step:
        return concat_rows([requantize(_row_range(qt, i, i + step), kind, group_size) for i in range(0, n, step)])
    if isinstance(qt, QuantizedTensor):
        qt = qt.dequantize(torch.float32)
    return quantize_int8(qt) if kind == "int8" else quantize_int4(qt, group_size)


def _row_range(qt: QuantizedTensor | torch.Tensor, start: int, stop: int) -> QuantizedTensor | torch.Tensor:
    if not isinstance(qt, QuantizedTensor):
        return qt[start:stop]
    return qt._map(lambda t: t[start:stop])


# ----- GGUF blocks (ggml's layouts: 32 values a block; Q4_K 256, 8 groups of 32; Q6_K 256, 16 groups of 16) -----

GGUF_DIRECT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """Rows of raw bytes ``[N, K / block * block_bytes]`` of a type in GGUF_DIRECT_TYPES -> the matching ember
    layout (Q8_0: int8 in groups of 32; the 4-bit blocks: int4; the 5-bit ones: int5; Q6_K: int6)."""
    n, k = shape
    if type_name in ("Q4_K", "Q5_K"):
        return _from_k_quant(raw, n, k, type_name)
    if type_name == "Q6_K":
        return _from_q6_k(raw, n, k)
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, -1)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8)).reshape(n, k)
        return QuantizedTensor("int8", q, d, None, 32)
    layouts = {"Q4_0": (2, None), "Q4_1": (4, None), "Q5_0": (6, 2), "Q5_1": (8, 4)}  # where the values, fifth bits lie
    if type_name not in layouts:
        raise ValueError(f"GGUF type {type_name} has no direct ember layout: direct types are {GGUF_DIRECT_TYPES}")
    at, high_at = layouts[type_name]
    if type_name in ("Q4_1", "Q5_1"):  # d * q + m, the f16 m after d
        offsets = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:  # d * (q - 8), d * (q - 16)
        offsets = (-8 if high_at is None else -16) * d
    qs = torch.from_numpy(blocks[..., at:at + 16].copy())  # element j in the low nibble of byte j, j + 16 the high
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1)
    if high_at is None:
        return QuantizedTensor("int4", pack_int4(q.reshape(n, k)), d, offsets, 32)
    qh = torch.from_numpy(blocks[..., high_at:high_at + 4].copy())  # the fifth bits: element j in bit j (little end)
    fifth = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return QuantizedTensor("int5", (q | (fifth.reshape(n, k // 32, 32) << 4)).reshape(n, k), d, offsets, 32)


def _from_k_quant(raw: np.ndarray, n: int, k: int, type_name: str) -> QuantizedTensor:
    """Q4_K / Q5_K super-blocks of 256 values (ggml's ``block_q4_K``: f16 d, f16 dmin, 12 bytes of 6-bit scales and
    mins for 8 sub-blocks of 32, [Q5_K: 32 bytes of fifth bits,] 128 bytes of 4-bit values) -> int4 / int5 in groups
    of 32 with ``scale = d * sc`` and ``offset = -dmin * m``: float32 products of an f16 and a 6-bit integer, exact,
    so ``q * scale + offset`` is ggml's value; d and -dmin kept as ``super_scales`` / ``super_offsets``."""
    five = type_name == "Q5_K"
    blocks = np.ascontiguousarray(raw).reshape(n, k // 256, 176 if five else 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scales = torch.from_numpy((d[..., None] * sc.astype(np.float32)).reshape(n, k // 32))
    offsets = torch.from_numpy((-(dmin[..., None] * mins.astype(np.float32))).reshape(n, k // 32))
    supers = torch.from_numpy(d), torch.from_numpy(-dmin)
    # each 64 values: 32 bytes, the first 32 values in their low nibbles, the next 32 in their high ones
    at = 48 if five else 16
    qs = torch.from_numpy(blocks[..., at:at + 128].copy()).view(n, k // 256, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3)  # [n, super-block, 64-value part i, half h, l]
    if not five:
        return QuantizedTensor("int4", pack_int4(q.reshape(n, k)), scales, offsets, 32, *supers)
    # value l + 32 h of part i has its fifth bit in bit 2 i + h of qh[l]
    qh = torch.from_numpy(blocks[..., 16:48].copy()).view(n, k // 256, 1, 1, 32)
    shift = (2 * torch.arange(4, dtype=torch.uint8)[:, None] + torch.arange(2, dtype=torch.uint8)).view(1, 1, 4, 2, 1)
    return QuantizedTensor("int5", (q | (((qh >> shift) & 1) << 4)).reshape(n, k), scales, offsets, 32, *supers)



def _from_q6_k(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    """Q6_K super-blocks of 256 values (ggml's ``block_q6_K``: 128 bytes of low four bits, 64 of high two bits, 16
    int8 scales, an f16 d) -> int6 in groups of 16, ``scale = d * sc`` (exact in float32), ``offset = -32 * scale``.
    Each half of 128 values: value 32 i + l has its low bits in ql[l + 32 (i % 2)] (the high nibble for i >= 2), its
    high bits in bits 2 i, 2 i + 1 of qh[l]."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // 256, 210)
    ql = torch.from_numpy(blocks[..., 0:128].copy()).view(n, k // 256, 2, 2, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [n, super-block, half, i, l]
    qh = torch.from_numpy(blocks[..., 128:192].copy()).view(n, k // 256, 2, 1, 32)
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)) & 3
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    scales = torch.from_numpy((d[..., None] * sc).reshape(n, k // 16))
    return QuantizedTensor("int6", (low | high << 4).reshape(n, k), scales, -32 * scales, 16, torch.from_numpy(d))
