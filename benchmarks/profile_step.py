"""Where one decode step's time goes: the model forward + LM head + argmax for B sequences of L tokens of context,
timed, then under torch.profiler (ops sorted by self time). ember's C++ kernels do not appear in the profiler's
table: their time is the timed step minus the table's total.

    python benchmarks/profile_step.py --batch 1 --context 600
    EMBER_CPU_KERNELS=0 python benchmarks/profile_step.py --batch 48 --context 400   # the torch fallback
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="EngineConfig.quantization ('none': float weights)")
    args = ap.parse_args()

    from ember.config import EngineConfig
    from ember.layers.attention import AttentionMetadata
    from ember.worker.worker import Worker

    torch.set_num_threads(args.threads)  # this thread runs every op, as the engine thread does
    B, L = args.batch, args.context
    cfg = EngineConfig(args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=L + 16,
                       max_num_seqs=B, kv_cache_memory="2GiB", quantization=args.quantization)
    resolved = cfg.resolve()
    worker = Worker(resolved.model, resolved.cache)
    worker.init_cache(cfg.scheduler(worker.loaded.max_position))
    model = worker.model
    nbl = -(-L // cfg.block_size)
    tables = torch.arange(B * nbl).view(B, nbl)
    slots = tables[:, (L - 1) // cfg.block_size] * cfg.block_size + (L - 1) % cfg.block_size
    meta = AttentionMetadata(slots, B, tables, torch.full((B,), L), [])
    ids, pos = torch.randint(100, 1000, (B,)), torch.full((B,), L - 1)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, meta)).argmax(-1)

    for _ in range(5):
        step()
    n, start = 30, time.perf_counter()
    for _ in range(n):
        step()
    ms = 1e3 * (time.perf_counter() - start) / n
    print(f"batch {B}, context {L}, {args.dtype}, quantization {args.quantization}: {ms:.2f} ms a step")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
