"""Paged attention over a flat, ragged batch, through a backend chosen once for the device and KV format.

The KV cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V. Every step
writes the new tokens' K/V into their slots (``slot_mapping``), then:
- decode tokens (one query each) are attended together: by the ``cpu-kernel`` backend with ember's compiled kernel,
  which reads each sequence's blocks in place (``ember.kernels``); on CUDA by the ``triton`` backend, which reads
  them in place too (the shapes a CUDA graph needs); by the ``torch`` backend (no compiler, a quantized pool)
  their blocks are gathered into one padded batch and a length mask hides the padding; grouped-query heads are
  folded into the query rows, so K/V are never repeated;
- prefill chunks are attended one sequence at a time, causally, against their whole context in the cache (SDPA,
  in every backend but ``cpu-kernel``'s bf16 path).
The batch is ordered decodes first, then prefills.
With a quantized KV cache (``KVCacheFormat`` int8 / uint4) K and V are quantized as they are written and the blocks
a step reads are dequantized after the gather (the compiled decode kernel reads float pools only, so a quantized
pool selects the ``torch`` backend); a fresh prompt chunk attends to its own exact K/V.

``select_attention_backend`` picks the backend once; ``bind_attention_backend`` gives it to every layer of a model,
so ``PagedAttention.forward`` holds no per-call device or format checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F

from ember.errors import ConfigError
from ember.kernels import kernels_for
from ember.layers.base import Layer
from ember.layers.kv_cache import KVCacheFormat

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row of this sequence in the flat batch
    length: int  # query tokens this step
    context_len: int  # tokens in the cache after this step, these included
    block_table: torch.Tensor  # [num_blocks_of_seq]
    draft: bool = False  # a decoding row verifying a draft: each token is a decode step's (its sequence ends at it)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index of every token of the batch
    num_decode: int  # the first num_decode rows are decode tokens
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decode]
    prefills: list[PrefillSpan]
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def sequence_ends(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] the length of each token's sequence after this step (a decode row, a drafted token: its position + 1;
        a prompt chunk's: the chunk's end)."""
        ends = positions + 1
        for span in self.prefills:
            if not span.draft:
                ends[span.start:span.start + span.length] = span.context_len
        return ends

    def decode_mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[num_decode, 1, 1, S] True where a key may be attended; cached per window across layers."""
        mask = self._masks.get(window)
        if mask is None:
            lens = self.decode_context_lens
            keys = torch.arange(self.decode_block_tables.shape[1] * block_size, device=lens.device)
            mask = keys[None, :] < lens[:, None]
            if window is not None:
                mask &= keys[None, :] >= (lens[:, None] - window)
            mask = mask[:, None, None, :]
            self._masks[window] = mask
        return mask


def _causal_mask(q_len: int, ctx: int, window: int | None, device: torch.device) -> torch.Tensor:
    rows = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    cols = torch.arange(ctx, device=device)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-cap of the scaled scores, ``cap * tanh(s / cap)``, as transformers writes it."""
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D]. With a soft-cap (which SDPA lacks) the scores are written out."""
    if softcap:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = _capped(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
    if q.shape[1] != k.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


_BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence against its gathered, padded context.

    q [nd, Hq, D]; k, v [nd, S, Hkv, D] as gathered (block-major); mask [nd, 1, 1, S] -> [nd, Hq, D].
    With few KV heads the query is spread block-diagonally over [Hkv * D] so that K and V are used in their
    gathered layout: no transposed copies, one bmm each, at the price of Hkv x the (tiny) score flops. Measured
    for 32 sequences x 160 tokens, 3 KV heads, bf16: 1.6 ms -> 0.26 ms a layer. Many KV heads use per-head bmm."""
    nd, S, Hkv, D = k.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    if Hkv <= _BLOCK_DIAGONAL_MAX_KV_HEADS:
        eye = torch.eye(Hkv, dtype=q.dtype, device=q.device)[None, :, None, :, None]
        qb = (q.view(nd, Hkv, G, 1, D) * eye).view(nd, Hq, Hkv * D)
        scores = _capped(torch.bmm(qb, k.view(nd, S, Hkv * D).transpose(1, 2)).float() * scale, softcap)
        probs = scores.masked_fill(~mask[:, 0], float("-inf")).softmax(dim=-1)
        out = torch.bmm(probs.to(v.dtype), v.view(nd, S, Hkv * D)).view(nd, Hkv, G, Hkv, D)
        return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(nd, Hq, D)
    qd = q.view(nd, Hkv, G, D)  # query heads of one KV group become rows
    scores = _capped(torch.matmul(qd, k.transpose(1, 2).transpose(-1, -2)).float() * scale, softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(v.dtype), v.transpose(1, 2)).reshape(nd, Hq, D)


def _quantized(fmt: KVCacheFormat | None) -> KVCacheFormat | None:
    """The format when the pool holds quantized entries, None when it holds the model's float."""
    return fmt if fmt is not None and fmt.quantized else None


def _gather(layer: PagedAttention, cache: torch.Tensor, blocks: torch.Tensor, fmt: KVCacheFormat | None,
            dtype: torch.dtype) -> torch.Tensor:
    """The blocks' entries as [len(blocks) * block_size, Hkv, D] in dtype (the query's)."""
    E = fmt.entry if fmt is not None else layer.head_dim
    g = cache.index_select(0, blocks).view(-1, layer.num_kv_heads, E)  # index_select: ~4x faster than indexing on CPU
    return fmt.unpack(g, dtype) if fmt is not None else g


class AttentionBackend:
    """How a ``PagedAttention`` layer stores its new K/V and attends, chosen once (``select_attention_backend``).

    One instance serves every layer of a model: it holds no per-layer state and reads the layer's caches, heads,
    window and scale at each call. Subclasses implement ``decode`` and ``prefill``; ``forward`` runs a step.
    ``batch_invariant``: a query's output is the same bits whether it is a decode row, in a fresh prompt or in a
    chunk after cached context (the ``cpu-kernel`` backend keeps it; the others do not promise it)."""

    __slots__ = ("batch_invariant",)
    name: ClassVar[str]
    softcap: ClassVar[bool] = False  # whether it applies a layer's score soft-cap (Gemma 2)

    def __init__(self, device: torch.device, batch_invariant: bool = True) -> None:
        """Construct through ``select_attention_backend``, which checks ``supports`` first."""
        self.batch_invariant = batch_invariant

    @classmethod
    def supports(cls, device: torch.device, kv_format: KVCacheFormat | None, block_size: int = 16) -> bool:
        """Whether this backend can run layers on device whose pool is in kv_format (None: the model's float) and
        holds block_size tokens a block."""
        raise NotImplementedError

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]: write the batch's K/V, then attend decodes and prefills."""
        T, Hq, D = q.shape
        fmt = _quantized(layer.kv_format)
        self.write(layer, k, v, meta.slot_mapping, fmt)
        nd = meta.num_decode
        if nd and nd == T:  # decode only: the kernel's result is the output, not copied into another buffer
            return self.decode(layer, q, meta, fmt).reshape(T, Hq * D)
        if not nd and len(meta.prefills) == 1 and meta.prefills[0].length == T:  # one chunk or drafted span: as is
            return self.prefill(layer, q, k, v, meta.prefills[0], fmt).reshape(T, Hq * D)
        out = q.new_empty(T, Hq, D)
        if nd:
            out[:nd] = self.decode(layer, q[:nd], meta, fmt)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.length)
            out[rows] = self.prefill(layer, q[rows], k[rows], v[rows], span, fmt)
        return out.view(T, Hq * D)

    def write(self, layer: PagedAttention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              fmt: KVCacheFormat | None) -> None:
        """Store k/v [T, Hkv, D] in their flat slots, quantized as they are written when the pool is."""
        E = fmt.entry if fmt is not None else layer.head_dim
        Hkv = layer.num_kv_heads
        layer.k_cache.view(-1, Hkv, E).index_copy_(0, slots, fmt.pack(k) if fmt is not None else k)
        layer.v_cache.view(-1, Hkv, E).index_copy_(0, slots, fmt.pack(v) if fmt is not None else v)

    def decode(self, layer: PagedAttention, q: torch.Tensor, meta: AttentionMetadata,
               fmt: KVCacheFormat | None) -> torch.Tensor:
        """The decode rows: q [nd, Hq, D] -> [nd, Hq, D]."""
        raise NotImplementedError

    def prefill(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                fmt: KVCacheFormat | None) -> torch.Tensor:
        """One sequence's chunk: q [L, Hq, D], its own k/v [L, Hkv, D] -> [L, Hq, D]."""
        raise NotImplementedError

    def prefill_memory_is_linear(self, layer: PagedAttention, dtype: torch.dtype) -> bool:
        """Whether a prefill in this layer takes memory in proportion to its tokens, however they split into
        prompts (beyond one output row a query, a fixed scratch). Start-up then measures a step's peak on short
        prompts, at a fraction of one long prompt's attention work. SDPA's scores grow with a prompt's length
        squared: not here."""
        return False


class TorchAttention(AttentionBackend):
    """Every device and KV format: decode gathers the blocks into a padded batch, prefill runs SDPA."""

    __slots__ = ()
    name = "torch"
    softcap = True

    @classmethod
    def supports(cls, device: torch.device, kv_format: KVCacheFormat | None, block_size: int = 16) -> bool:
        return True

    def decode(self, layer: PagedAttention, q: torch.Tensor, meta: AttentionMetadata,
               fmt: KVCacheFormat | None) -> torch.Tensor:
        nd, Hkv, D = q.shape[0], layer.num_kv_heads, layer.head_dim
        flat = meta.decode_block_tables.view(-1)
        kd = _gather(layer, layer.k_cache, flat, fmt, q.dtype).view(nd, -1, Hkv, D)
        vd = _gather(layer, layer.v_cache, flat, fmt, q.dtype).view(nd, -1, Hkv, D)
        mask = meta.decode_mask(layer.sliding_window, layer.k_cache.shape[1])
        return _decode_attention(q, kd, vd, mask, layer.scale, layer.softcap)

    def prefill(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                fmt: KVCacheFormat | None) -> torch.Tensor:
        qs = q.transpose(0, 1).unsqueeze(0)
        fresh = span.context_len == span.length
        if fresh:  # nothing cached before this chunk: attend to the chunk's own K/V
            ks, vs = k, v
        else:
            ks = _gather(layer, layer.k_cache, span.block_table, fmt, q.dtype)[:span.context_len]
            vs = _gather(layer, layer.v_cache, span.block_table, fmt, q.dtype)[:span.context_len]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        window = layer.sliding_window
        if fresh and (window is None or span.context_len <= window):
            o = _sdpa(qs, ks, vs, None, True, layer.scale, layer.softcap)
        else:
            mask = _causal_mask(span.length, span.context_len, window, q.device)
            o = _sdpa(qs, ks, vs, mask, False, layer.scale, layer.softcap)
        return o.squeeze(0).transpose(0, 1)


class InPlaceAttention(TorchAttention):
    """A float pool that kernels write and read in place: ``kernels`` holds ``write_kv_`` (both pools in one pass)
    and ``paged_decode_attention`` (each sequence's blocks read where they lie, no gathered copy)."""

    __slots__ = ("kernels",)
    softcap = False

    def write(self, layer: PagedAttention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              fmt: KVCacheFormat | None) -> None:
        self.kernels.write_kv_(layer.k_cache, layer.v_cache, k, v, slots)

    def decode(self, layer: PagedAttention, q: torch.Tensor, meta: AttentionMetadata,
               fmt: KVCacheFormat | None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, layer.k_cache, layer.v_cache, meta.decode_block_tables,
                                                   meta.decode_context_lens, layer.sliding_window or 0, layer.scale)


class CpuKernelAttention(InPlaceAttention):
    """CPU with ember's compiled kernels and a float pool. Decode and prefill rows run the same arithmetic (the
    AVX512-BF16 kernels for bf16 with head size 64, 128 or 256 where they were built, the portable kernel otherwise),
    so batch invariance holds across decode, fresh prefill, chunks and prefix-cache hits. With batch_invariant=False
    decode takes the faster bf16 decode kernel (64 and 128) and prefill the portable shapes SDPA, as ``torch``."""

    __slots__ = ()
    name = "cpu-kernel"

    def __init__(self, device: torch.device, batch_invariant: bool = True) -> None:
        super().__init__(device, batch_invariant)
        kernels = kernels_for(device)
        if kernels is None:
            raise RuntimeError(f"the compiled CPU kernels are not available on {device}")
        self.kernels: ModuleType = kernels

    @classmethod
    def supports(cls, device: torch.device, kv_format: KVCacheFormat | None, block_size: int = 16) -> bool:
        return _quantized(kv_format) is None and kernels_for(device) is not None

    def decode(self, layer: PagedAttention, q: torch.Tensor, meta: AttentionMetadata,
               fmt: KVCacheFormat | None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, layer.k_cache, layer.v_cache, meta.decode_block_tables,
                                                   meta.decode_context_lens, layer.sliding_window or 0, layer.scale,
                                                   self.batch_invariant)

    def prefill(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                fmt: KVCacheFormat | None) -> torch.Tensor:
        """ember's kernel over the paged context (no gather; prefix hits and earlier chunks included); with
        batch_invariant=False, SDPA as ``torch`` where the AVX512-BF16 kernel does not take the shape."""
        if self._kernel_prefill(layer, q.dtype):
            return self.kernels.paged_prefill_attention(q, layer.k_cache, layer.v_cache, span.block_table,
                                                        span.context_len, layer.sliding_window or 0, layer.scale)
        return super().prefill(layer, q, k, v, span, fmt)

    def prefill_memory_is_linear(self, layer: PagedAttention, dtype: torch.dtype) -> bool:
        """ember's prefill kernel holds a fixed scratch a thread: its memory is its output's."""
        return self._kernel_prefill(layer, dtype)

    def _kernel_prefill(self, layer: PagedAttention, dtype: torch.dtype) -> bool:
        avx512 = dtype == torch.bfloat16 and layer.head_dim in (64, 128, 256) and self.kernels.has_avx512_bf16()
        return self.batch_invariant or avx512


class TritonAttention(InPlaceAttention):
    """CUDA with Triton and a float pool: ``ember.kernels.triton_attention`` writes and decodes in place, so a
    decode step's shapes are fixed by its batch size and block-table width, as a CUDA graph needs; prefill as
    ``torch``."""

    __slots__ = ()
    name = "triton"

    def __init__(self, device: torch.device, batch_invariant: bool = True) -> None:
        super().__init__(device, batch_invariant)
        from ember.kernels import triton_attention

        self.kernels: ModuleType = triton_attention

    @classmethod
    def supports(cls, device: torch.device, kv_format: KVCacheFormat | None, block_size: int = 16) -> bool:
        if device.type != "cuda" or kv_format is None or _quantized(kv_format) is not None:
            return False
        from ember.kernels import triton_attention

        return triton_attention.shapes_supported(block_size, kv_format.head_dim) and triton_attention.available()


# name -> backend, in order of preference: selection takes the first that supports the device and KV format
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (CpuKernelAttention, TritonAttention, TorchAttention)}


def select_attention_backend(device: torch.device, kv_format: KVCacheFormat | None, name: str | None = None,
                             block_size: int = 16, batch_invariant: bool = True) -> AttentionBackend:
    """The backend for layers on device with a pool in kv_format: ``name`` when given, else the first of
    ``ATTENTION_BACKENDS`` that supports them (the compiled kernel for a float pool on CPU, Triton's on CUDA, else
    torch)."""
    if name is None:
        name = next(n for n, b in ATTENTION_BACKENDS.items() if b.supports(device, kv_format, block_size))
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ConfigError(f"attention backend {name!r} is unknown: use one of {tuple(ATTENTION_BACKENDS)}")
    if not backend.supports(device, kv_format, block_size):
        kind = kv_format.kind if kv_format is not None else "auto"
        raise ConfigError(f"attention backend {name!r} cannot run on {device} with kv_cache_dtype={kind!r}")
    return backend(device, batch_invariant)


def bind_attention_backend(layers: list[PagedAttention], device: torch.device, kv_format: KVCacheFormat | None,
                           block_size: int = 16, name: str | None = None,
                           batch_invariant: bool = True) -> AttentionBackend:
    """Select the backend once and give it to every layer; returns it (its ``name`` says which). Layers with a
    score soft-cap take the ``torch`` backend (the compiled kernels do not cap)."""
    capped = any(layer.softcap for layer in layers)
    if capped and name is None:
        name = TorchAttention.name
    backend = select_attention_backend(device, kv_format, name, block_size, batch_invariant)
    if capped and not backend.softcap:
        raise ConfigError(f"attention backend {name!r} cannot soft-cap attention scores (attn_logit_softcapping): "
                          f"use {TorchAttention.name!r}")
    for layer in layers:
        layer.backend = backend
    return backend


class PagedAttention(Layer):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> None:
        """scale: what the scores are multiplied by (default head_dim ** -0.5; Gemma's query_pre_attn_scalar);
        softcap: scaled scores become ``softcap * tanh(s / softcap)`` (Gemma 2), None: not capped."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap or None
        self.sliding_window = sliding_window
        # bound by the model runner once the pool is allocated
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_format: KVCacheFormat | None = None  # None: the pool holds the model's float
        # set by bind_attention_backend; a layer built on its own selects one at its first call and keeps it
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        if self.backend is None:
            self.backend = select_attention_backend(q.device, self.kv_format)
        return self.backend.forward(self, q, k, v, meta)
