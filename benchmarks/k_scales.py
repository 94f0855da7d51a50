"""A K-quant GGUF's step with its Q4_K / Q5_K weights' scales as stored (f16 d and -dmin a super-block, a byte sc
and m a group: ``pack_k_scales``) against bf16 (scale, zero) pairs, in one process: the model is loaded once, each
such weight's scales are swapped between the two layouts in place, and steps of each are timed in turn (medians of
interleaved repeats), so both see the same machine. docs/quantization.md's figures.

    python benchmarks/k_scales.py --model /tmp/qwen2.5-coder-1.5b-q4_k_m.gguf --batch 1 --context 256
    python benchmarks/k_scales.py --model /tmp/qwen2.5-coder-1.5b-q4_k_m.gguf --prefill --context 512 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a GGUF with Q4_K or Q5_K weights")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="a prefill step of B sequences of L tokens instead")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()

    from ember.config import EngineConfig
    from ember.layers.attention import AttentionMetadata, PrefillSpan
    from ember.quantization.kernels import CpuInt4Path, _scale_zeros, block_scale_zeros, unpack_k_scales
    from ember.quantization.tensor import QuantizedTensor
    from ember.worker.worker import Worker

    torch.set_num_threads(args.threads)
    B, L = args.batch, args.context
    cfg = EngineConfig(args.model, num_threads=args.threads, max_model_len=L + 16, max_num_seqs=B,
                       kv_cache_memory="1GiB")
    resolved = cfg.resolve()
    worker = Worker(resolved.model, resolved.cache)
    worker.init_cache(cfg.scheduler(worker.loaded.max_position))
    model = worker.model
    impls: dict[int, CpuInt4Path] = {}
    for module in model.modules():
        mm = getattr(module, "qmm", None)
        for part in getattr(mm, "parts", (mm,)) if mm is not None else ():
            if isinstance(part.impl, CpuInt4Path) and part.impl.s.dtype == torch.uint8:
                impls[id(part.impl)] = part.impl
    if not impls:
        raise SystemExit(f"{args.model}: no weight holds K-quant scales here (no Q4_K / Q5_K weight with K a "
                         "multiple of 256, or AMX / int8 activations, which take the pairs)")
    layouts = []  # (K-quant scales, the same values as bf16 pairs) a weight
    for im in impls.values():
        scales, offsets = unpack_k_scales(im.s, im.n, im.k)
        pairs = block_scale_zeros(_scale_zeros(QuantizedTensor("int4", im.w, scales, offsets, 32)))
        layouts.append((im.s, pairs))
    print(f"{len(impls)} weights: scales {sum(k.numel() for k, _ in layouts) / 1e6:.1f} MB as stored, "
          f"{sum(p.numel() * 2 for _, p in layouts) / 1e6:.1f} MB as pairs")

    nbl = -(-L // cfg.block_size)
    tables = torch.arange(B * nbl).view(B, nbl)
    if args.prefill:
        slots = (tables[:, :, None] * cfg.block_size + torch.arange(cfg.block_size)).view(B, -1)[:, :L].reshape(-1)
        meta = AttentionMetadata(slots, 0, None, None, [PrefillSpan(b * L, L, L, tables[b]) for b in range(B)])
        ids, pos, last = torch.randint(100, 1000, (B * L,)), torch.arange(L).repeat(B), torch.arange(1, B + 1) * L - 1
    else:
        slots = tables[:, (L - 1) // cfg.block_size] * cfg.block_size + (L - 1) % cfg.block_size
        meta = AttentionMetadata(slots, B, tables, torch.full((B,), L), [])
        ids, pos, last = torch.randint(100, 1000, (B,)), torch.full((B,), L - 1), torch.arange(B)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, meta)[last]).argmax(-1)

    def timed(which: int, steps: int) -> float:
        for im, pair in zip(impls.values(), layouts):
            im.s = pair[which]
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps

    steps = 3 if args.prefill else 20
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.repeats):
        for which in (0, 1):
            times[which].append(timed(which, steps))
    kq, pairs = statistics.median(times[0]), statistics.median(times[1])
    kind = "prefill" if args.prefill else "decode"
    print(f"batch {B}, {kind} at context {L}: as stored {1e3 * kq:.2f} ms, pairs {1e3 * pairs:.2f} ms a step: "
          f"{pairs / kq:.3f}x (per repeat {', '.join(f'{p / k:.3f}' for k, p in zip(times[0], times[1]))})")


if __name__ == "__main__":
    main()
