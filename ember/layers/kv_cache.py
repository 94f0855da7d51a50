"""How one token-head of K or V is stored in the paged pool: the model's float, or int8 / uint4 with its own scale.

A quantized entry is a row of bytes in a uint8 pool, so the pool stays one tensor (block copies, the host tier and
zeroing work unchanged) at a fraction of the size:
- int8: D int8 values then a float32 scale (symmetric: ``x = q * scale``): D + 4 bytes;
- uint4: D / 2 bytes of two 4-bit values (element 2i in the low nibble) then, for each group of 32 values, a
  float32 scale and a float32 minimum (asymmetric, the zero point as a minimum: ``x = q * scale + min``):
  D / 2 + D / 4 bytes. One scale for a whole head of 64 cost SmolLM2-135M 11% perplexity, groups of 32 cost 5.6%.
For D = 64 and a bf16 model: 128 bytes -> 68 (int8) or 48 (uint4). Entries are quantized as they are written and
dequantized as attention reads them; a zeroed entry reads as zeros.
"""

from __future__ import annotations

import torch

from ember.config import KV_CACHE_DTYPES
from ember.quantization.tensor import quantize_int8_symmetric

UINT4_GROUP = 32  # values sharing one scale and minimum in a uint4 entry (the whole head when smaller)


class KVCacheFormat:
    __slots__ = ("kind", "head_dim", "dtype", "entry", "pool_dtype", "group")

    def __init__(self, kind: str, head_dim: int, dtype: torch.dtype) -> None:
        if kind not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kind!r} is not supported: use one of {KV_CACHE_DTYPES}")
        if kind == "uint4" and head_dim % 8:
            raise ValueError(f"kv_cache_dtype='uint4' needs a head_dim divisible by 8, this model has {head_dim}")
        if kind == "int8" and head_dim % 4:
            raise ValueError(f"kv_cache_dtype='int8' needs a head_dim divisible by 4, this model has {head_dim}")
        self.kind, self.head_dim, self.dtype = kind, head_dim, dtype
        self.group = UINT4_GROUP if head_dim % UINT4_GROUP == 0 else head_dim
        self.entry = {"auto": head_dim, "int8": head_dim + 4, "uint4": head_dim // 2 + head_dim // self.group * 8}[kind]
        self.pool_dtype = dtype if kind == "auto" else torch.uint8

    @property
    def quantized(self) -> bool:
        return self.kind != "auto"

    def bytes_per_entry(self) -> int:
        """Bytes of one token-head of K (or V)."""
        return self.entry * (torch.finfo(self.dtype).bits // 8 if self.kind == "auto" else 1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] float -> [..., entry] pool entries."""
        if self.kind == "auto":
            return x
        x = x.float()
        if self.kind == "int8":
            q, scale = quantize_int8_symmetric(x)
            return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
        g = x.view(*x.shape[:-1], -1, self.group)
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((g - lo) / scale).round().clamp(0, 15).to(torch.uint8).view(x.shape)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        as_bytes = lambda t: t.view(*x.shape[:-1], -1).contiguous().view(torch.uint8)  # noqa: E731
        return torch.cat([packed, as_bytes(scale), as_bytes(lo)], dim=-1)

    def unpack(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., entry] pool entries -> [..., D] in dtype."""
        if self.kind == "auto":
            return p
        d = self.head_dim
        if self.kind == "int8":
            scale = p[..., d:d + 4].contiguous().view(torch.float32)
            return (p[..., :d].view(torch.int8).to(dtype) * scale.to(dtype))
        h, n = d // 2, d // self.group
        scale = p[..., h:h + 4 * n].contiguous().view(torch.float32)[..., None]
        lo = p[..., h + 4 * n:h + 8 * n].contiguous().view(torch.float32)[..., None]
        b = p[..., :h]
        q = torch.stack([b & 0xF, b >> 4], dim=-1).view(*b.shape[:-1], n, self.group)
        return (q.to(torch.float32) * scale + lo).view(*b.shape[:-1], d).to(dtype)
