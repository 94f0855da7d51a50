"""Quantized matmuls: a QuantizedTensor re-laid out once for the device's kernel, then ``y = x W^T``.

CPU: torch's packed ops (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, ``_int_mm``). They are fast
for decode-sized batches and only in bf16 (fp32 inputs run 10-40x slower), so activations enter them as bf16
whatever the model's dtype. For big batches (prefill chunks) dequantizing the weight once and running one dense
matmul is faster than the packed ops: measured for a 1536x576 weight, 512 rows, bf16: packed int8 7.4 ms, int4
6.9 ms, dequantize + matmul 2.1 ms; at 64 rows the packed ops win (0.7 ms vs 0.75 ms; at 1 row 17 us vs 360 us).
Only the packed form is kept: the dense path unpacks it. Other devices (CUDA) dequantize per call: correct
everywhere; a fast CUDA kernel is future work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.quantization.tensor import QuantizedTensor

DENSE_MIN_ROWS = 128  # from this many rows on, dequantize + one dense matmul beats the packed CPU ops
_INT4_BLOCK_N = 64  # the CPU int4 pack interleaves 64 output rows; other row counts take the portable path


def _fast_cpu(device: torch.device, op: str) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, op)


def unpack_cpu_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Invert ``_convert_weight_to_int4pack_for_cpu``: bytes [N/64, K, 32], row r of a 64-row block in byte
    r % 32, low nibble for r < 32 -> values uint8 [N, K]."""
    p = packed.view(n // _INT4_BLOCK_N, k, _INT4_BLOCK_N // 2)
    q = torch.cat([p & 0xF, p >> 4], dim=2)  # [N/64, K, 64]
    return q.transpose(1, 2).reshape(n, k)


class QuantizedMatmul:
    """A weight prepared for ``method`` ('int8' | 'int4' | 'w8a8') on its tensors' device."""

    __slots__ = ("method", "n", "k", "group_size", "qt", "int8", "int8_t", "scales", "packed", "scale_zeros")

    def __init__(self, method: str, qt: QuantizedTensor) -> None:
        self.method = method
        self.n, self.k = qt.shape
        self.group_size = qt.group_size
        self.qt: QuantizedTensor | None = None  # the portable form, kept only when no fast path took it
        self.int8 = self.int8_t = self.scales = self.packed = self.scale_zeros = None
        device = qt.data.device
        if method == "int4" and _fast_cpu(device, "_weight_int4pack_mm_for_cpu") and self.n % _INT4_BLOCK_N == 0:
            # the kernel's form: w = (q - 8) * scale + zero, so zero = offset + 8 * scale
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.unpacked().to(torch.int32), 1)
            zeros = qt.offsets + 8 * qt.scales
            self.scale_zeros = torch.stack([qt.scales, zeros], dim=-1).transpose(0, 1).contiguous().bfloat16()
        elif method == "int8" and _fast_cpu(device, "_weight_int8pack_mm"):
            self.int8, self.scales = qt.data.contiguous(), qt.scales.view(-1).bfloat16()  # the op's scale dtype
        elif method == "w8a8" and _fast_cpu(device, "_int_mm"):
            self.int8_t, self.scales = qt.data.t().contiguous(), qt.scales.view(-1).float()  # _int_mm takes [K, N]
        else:
            self.qt = qt

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.packed is not None:
            sz = self.scale_zeros.float()  # [G, N, 2]
            g = self.group_size
            q = unpack_cpu_int4(self.packed, self.n, self.k).float().view(self.n, self.k // g, g)
            scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
            return ((q - 8) * scale + zero).view(self.n, self.k).to(dtype)
        if self.int8 is not None:
            return self.int8.to(dtype) * self.scales.to(dtype)[:, None]
        if self.int8_t is not None:
            return self.int8_t.t().to(dtype) * self.scales.to(dtype)[:, None]
        return self.qt.dequantize(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.method == "w8a8":
            return self._w8a8(x)
        if rows >= DENSE_MIN_ROWS or (self.packed is None and self.int8 is None):
            return F.linear(x, self.dequantized(x.dtype))
        xb = x.reshape(rows, self.k).to(torch.bfloat16)
        if self.packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group_size, self.scale_zeros)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.int8, self.scales)
        return y.to(x.dtype).view(*x.shape[:-1], self.n)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic per-token int8 activations x int8 per-channel weights, int32 accumulation, float rescale."""
        x2 = x.reshape(-1, self.k).float()
        xs = (x2.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-10)
        xq = (x2 / xs).round().clamp(-127, 127).to(torch.int8)
        if self.int8_t is not None:
            acc = torch._int_mm(xq, self.int8_t).float()
            scales = self.scales
        else:  # no int8 GEMM here: the same arithmetic in float (exact while the int32 sums stay below 2**24)
            acc = xq.float() @ self.qt.data.float().t()
            scales = self.qt.scales.view(-1)
        return (acc * xs * scales).to(x.dtype).view(*x.shape[:-1], self.n)

    def tensors(self) -> list[torch.Tensor]:
        """What this weight holds in memory."""
        held = [self.int8, self.int8_t, self.scales, self.packed, self.scale_zeros]
        if self.qt is not None:
            held += [self.qt.data, self.qt.scales, self.qt.offsets]
        return [t for t in held if t is not None]
