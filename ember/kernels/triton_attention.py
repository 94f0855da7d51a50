"""Paged decode attention and the KV write for CUDA, as Triton kernels.

Both read and write the pool in place (``[num_blocks, block_size, Hkv, D]``), so a decode step gathers nothing and
its shapes depend only on the batch size and the block-table width: what a CUDA graph needs (``cuda_graph.py``).
A row whose slot is negative is not written and a sequence of length 0 attends to nothing (its output is zeros):
that is how a graph's padding rows run without touching the pool.

Triton is imported on first use, so CPU-only machines never import it; ``available()`` says whether it can run.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def shapes_supported(block_size: int, head_dim: int) -> bool:
    """tl.arange needs powers of two: the block size and the head size (64 and 128 in every model served)."""
    return all(n >= 1 and n & (n - 1) == 0 for n in (block_size, head_dim))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, tables_ptr, lens_ptr, scale, window,
                      stride_q, stride_o, stride_t, stride_block, stride_slot,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                      PART_BLOCKS: tl.constexpr, NUM_PARTS: tl.constexpr):
        """One program: one sequence's query heads of one KV head, against the blocks of its part of the context in
        order (online softmax). With one part it writes the output; with several, each part writes its normalised
        output and log-sum-exp for ``merge_kernel``."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(lens_ptr + seq).to(tl.int32)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        s_in_block = tl.arange(0, BLOCK)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + seq * stride_q + heads[:, None] * D + d[None, :], mask=(g < GROUP)[:, None],
                    other=0.0).to(tl.float32)
        start = ctx * 0  # the first key attended: 0, or the window's first
        if window > 0:
            start = ctx - window
            start = start * (start > 0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        kv_off = kvh * D + s_in_block[:, None] * stride_slot + d[None, :]
        first = start // BLOCK
        last = tl.cdiv(ctx, BLOCK)
        if NUM_PARTS > 1:
            first = tl.maximum(first, part * PART_BLOCKS)
            last = tl.minimum(last, (part + 1) * PART_BLOCKS)
        for b in range(first, last):
            block = tl.load(tables_ptr + seq * stride_t + b).to(tl.int64)
            pos = b * BLOCK + s_in_block
            valid = (pos < ctx) & (pos >= start)
            k = tl.load(k_ptr + block * stride_block + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + block * stride_block + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            total = total * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / tl.maximum(total, 1e-30)[:, None]  # nothing attended (a graph's padding, an empty part): zeros
        keep = (g < GROUP)[:, None]
        if NUM_PARTS == 1:
            tl.store(out_ptr + seq * stride_o + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=keep)
        else:
            row = (seq * GROUP * tl.num_programs(1) + heads) * NUM_PARTS + part  # [n, Hq, parts] in float32
            tl.store(out_ptr + row[:, None] * D + d[None, :], out, mask=keep)
            tl.store(lse_ptr + row, m + tl.log(total), mask=g < GROUP)

    @triton.jit
    def merge_kernel(part_ptr, lse_ptr, out_ptr, stride_o, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                     D: tl.constexpr):
        """One program: one query head of one sequence, its parts' outputs weighted by their share of the softmax."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, PARTS_PAD)
        d = tl.arange(0, D)
        row = (seq * tl.num_programs(1) + head) * NUM_PARTS
        lse = tl.load(lse_ptr + row + parts, mask=parts < NUM_PARTS, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)  # every part empty: weights 0, output 0
        w = tl.exp(lse - top)
        outs = tl.load(part_ptr + (row + parts)[:, None] * D + d[None, :], mask=(parts < NUM_PARTS)[:, None],
                       other=0.0)
        out = tl.sum(w[:, None] * outs, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
        tl.store(out_ptr + seq * stride_o + head * D + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v,
                     WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr):
        """One program: one token's K and V rows ([Hkv * D]) into its slot; a negative slot writes nothing."""
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            i = tl.arange(0, WIDTH_PAD)
            keep = i < WIDTH
            tl.store(k_cache_ptr + slot * WIDTH + i, tl.load(k_ptr + t * stride_k + i, mask=keep), mask=keep)
            tl.store(v_cache_ptr + slot * WIDTH + i, tl.load(v_ptr + t * stride_v + i, mask=keep), mask=keep)

    return triton, decode_kernel, merge_kernel, write_kernel


PART_BLOCKS = 16  # blocks of context one program reads when a sequence's context is split over programs


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """Programs that run at once, roughly: one a multiprocessor (1 off CUDA, in Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] (one token a sequence), caches [num_blocks, block_size, Hkv, D], block_tables [n, width],
    context_lens [n] -> [n, Hq, D]; window > 0 attends to the last ``window`` keys only.

    While n x Hkv programs leave multiprocessors idle (small batches), each sequence's context is split into parts
    of PART_BLOCKS blocks, one program each, merged by their log-sum-exp (flash-decoding); the number of parts
    follows the table width, so a CUDA graph (whose tables are max_model_len wide) launches the same grid each
    replay and parts past a sequence's end return at once. H100, SmolLM2-135M's shapes, batch 1 at a 512-token
    prompt: 5.77 -> 3.95 ms a decoded token (docs/cuda.md)."""
    triton, decode_kernel, merge_kernel, _ = _kernels()
    n, hq, d = q.shape
    _, block, hkv, _ = k_cache.shape
    group = hq // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    parts = triton.cdiv(block_tables.shape[1], PART_BLOCKS) if n * hkv < _multiprocessors(q.device) else 1
    common = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK=block, D=d, PART_BLOCKS=PART_BLOCKS,
                  NUM_PARTS=parts)
    strides = (q.stride(0), out.stride(0), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1))
    if parts == 1:
        decode_kernel[(n, hkv, 1)](q, k_cache, v_cache, out, out, block_tables, context_lens, scale, window,
                                   *strides, **common)
        return out
    partial = torch.empty(n, hq, parts, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, hq, parts, dtype=torch.float32, device=q.device)
    decode_kernel[(n, hkv, parts)](q, k_cache, v_cache, partial, lse, block_tables, context_lens, scale, window,
                                   *strides, **common)
    merge_kernel[(n, hq)](partial, lse, out, out.stride(0), NUM_PARTS=parts,
                          PARTS_PAD=triton.next_power_of_2(parts), D=d)
    return out


def write_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into flat slots of the caches; rows whose slot is negative are skipped."""
    triton, _, _, write_kernel = _kernels()
    t, hkv, d = k.shape
    if t == 0:
        return
    width = hkv * d
    k, v = k.reshape(t, width), v.reshape(t, width)  # a view: rows of the fused QKV output keep their stride
    write_kernel[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), WIDTH=width,
                       WIDTH_PAD=triton.next_power_of_2(width))
