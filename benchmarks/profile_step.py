"""Where one decode step's time goes: the model forward + LM head + argmax for B sequences of L tokens of context,
timed, then under torch.profiler (ops sorted by self time). ember's C++ kernels do not appear in the profiler's
table: their time is the timed step minus the table's total. ``--modules`` times each layer module instead
(forward hooks: every projection, attention, norm and the LM head, summed over the layers), which names the
kernels' time too.

    python benchmarks/profile_step.py --batch 1 --context 600
    python benchmarks/profile_step.py --model /tmp/qwen2.5-coder-1.5b-q4_k_m.gguf --context 256 --modules
    EMBER_CPU_KERNELS=0 python benchmarks/profile_step.py --batch 48 --context 400   # the torch fallback
    python benchmarks/profile_step.py --prefill --batch 1 --context 512 --modules      # a prefill step
    python benchmarks/profile_step.py --verify 4 --context 256   # a row verifying 4 drafted tokens
"""

from __future__ import annotations

import argparse
import collections
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
    ap.add_argument("--variant", action="store_true",
                    help="batch_invariant=False: the kernels whose rounding depends on the batch")
    ap.add_argument("--int8-activations", action="store_true",
                    help="int8_activations=True: int4 weights against int8 activations")
    ap.add_argument("--modules", action="store_true", help="time each layer module (hooks) instead of the ops")
    ap.add_argument("--prefill", action="store_true",
                    help="a prefill step instead: B sequences of L new prompt tokens each, empty caches")
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="B rows verifying K drafted tokens each at context L (speculative decoding's step: K + 1 "
                         "tokens a row, a draft span over the paged cache, every position's logits)")
    args = ap.parse_args()

    from ember.config import EngineConfig
    from ember.layers.attention import AttentionMetadata, PrefillSpan
    from ember.worker.worker import Worker

    torch.set_num_threads(args.threads)  # this thread runs every op, as the engine thread does
    B, L = args.batch, args.context
    cfg = EngineConfig(args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=L + 16,
                       max_num_seqs=B, kv_cache_memory="2GiB", quantization=args.quantization,
                       batch_invariant=not args.variant, int8_activations=args.int8_activations)
    resolved = cfg.resolve()
    worker = Worker(resolved.model, resolved.cache)
    worker.init_cache(cfg.scheduler(worker.loaded.max_position))
    model = worker.model
    nbl = -(-L // cfg.block_size)
    tables = torch.arange(B * nbl).view(B, nbl)
    slots = tables[:, (L - 1) // cfg.block_size] * cfg.block_size + (L - 1) % cfg.block_size
    if args.verify:  # each sequence's last K + 1 tokens new, every one of them a sampled position
        K = args.verify + 1
        flat = (tables[:, :, None] * cfg.block_size + torch.arange(cfg.block_size)).view(B, -1)
        slots = flat[:, L - K:L].reshape(-1)
        meta = AttentionMetadata(slots, 0, None, None, [PrefillSpan(b * K, K, L, tables[b], draft=True)
                                                        for b in range(B)])
        ids, pos = torch.randint(100, 1000, (B * K,)), torch.arange(L - K, L).repeat(B)
        last = torch.arange(B * K)
    elif args.prefill:  # each sequence's L tokens in one span; the LM head reads each sequence's last row only
        slots = (tables[:, :, None] * cfg.block_size + torch.arange(cfg.block_size)).view(B, -1)[:, :L].reshape(-1)
        meta = AttentionMetadata(slots, 0, None, None, [PrefillSpan(b * L, L, L, tables[b]) for b in range(B)])
        ids, pos = torch.randint(100, 1000, (B * L,)), torch.arange(L).repeat(B)
        last = torch.arange(1, B + 1) * L - 1
    else:
        meta = AttentionMetadata(slots, B, tables, torch.full((B,), L), [])
        ids, pos = torch.randint(100, 1000, (B,)), torch.full((B,), L - 1)
        last = torch.arange(B)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, meta)[last]).argmax(-1)

    for _ in range(5):
        step()
    n, start = 30, time.perf_counter()
    for _ in range(n):
        step()
    ms = 1e3 * (time.perf_counter() - start) / n
    kind = "prefill of" if args.prefill else f"verifying {args.verify} drafted at" if args.verify else "decode at"
    print(f"batch {B}, {kind} context {L}, {args.dtype}, quantization {args.quantization}: {ms:.2f} ms a step")
    if args.modules:
        module_times(model, step)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def module_times(model: torch.nn.Module, step, steps: int = 10) -> None:
    """ms a step in each kind of layer module (class, layout, name: ``MergedLinear int4 gate_up_proj``), summed
    over the layers; a module's time includes its children's, so MLP holds its projections."""
    total, calls, start = collections.Counter(), collections.Counter(), {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name.count(".") < 3 and not leaf.endswith(("lm_head", "norm")):
            continue  # the model and its layer lists: the whole step
        key = f"{type(mod).__name__} {getattr(mod, 'kind', '') or '-'} {leaf}"

        def begin_hook(module, args) -> None:
            start[id(module)] = time.perf_counter()

        def end_hook(module, args, output, key=key) -> None:  # returns None: the output stays as it is
            total[key] += time.perf_counter() - start[id(module)]
            calls[key] += 1

        mod.register_forward_pre_hook(begin_hook)
        mod.register_forward_hook(end_hook)
    for _ in range(3):
        step()
    total.clear()
    calls.clear()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    print(f"with the hooks: {1e3 * (time.perf_counter() - began) / steps:.2f} ms a step")
    for key, seconds in total.most_common():
        print(f"{key:<45} x{calls[key] // steps:<3} {1e3 * seconds / steps:8.2f} ms")


if __name__ == "__main__":
    main()
