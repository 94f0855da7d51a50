"""ember's two int8 kernels on the real models' int8 shapes: the AVX512-BF16 path (`int8_gemm`, each weight widened
to bf16) and, on AMX machines, the exact integer path (`int8_exact_gemm`: x in three unsigned bytes an input, vpdpbusd
for 1-4 rows, AMX integer tiles above). Interleaved calls, median ms a call, the weights cycled so that a call reads
them from memory (`--bytes` of weights, past the caches), with the share of each kernel's outputs that equal the
float64 product rounded to bf16.

    python benchmarks/int8_exact.py [--threads 2] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {  # N x K: the LM heads of Qwen2.5-Coder-1.5B, Gemma 3 270M and SmolLM2-135M; a 1.5B layer (Q6_K as int8)
    "qwen15-lm-head": (151936, 1536),
    "gemma3-lm-head": (262144, 640),
    "smollm2-lm-head": (49152, 576),
    "qwen15-gate-up": (17920, 1536),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,16,64,256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bytes", type=float, default=600e6, help="weight bytes cycled through (past the caches)")
    args = ap.parse_args()
    from ember.kernels import cpu_kernels

    k = cpu_kernels()
    if k is None or not k.has_amx():
        raise SystemExit("needs ember's CPU kernels on a machine with AMX")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("| weight | rows | AVX512-BF16 ms | exact ms | speed-up | outputs equal to exact product: AVX512 / exact |")
    print("|---|---|---|---|---|---|")
    for name, (n, kk) in SHAPES.items():
        copies = max(1, int(args.bytes // (n * kk)))
        ws = [torch.randint(-127, 128, (n, kk), dtype=torch.int8) for _ in range(copies)]
        sums = [w.sum(1, dtype=torch.int32) for w in ws]
        scales = torch.rand(n) / 64
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, kk).bfloat16()
            runs = {"avx": lambda i: k.int8_gemm(x, ws[i], scales, True),
                    "exact": lambda i: k.int8_exact_gemm(x, ws[i], sums[i], scales)}
            times = {key: [] for key in runs}
            for key, fn in runs.items():
                fn(0)
            for rep in range(args.repeats):
                for key, fn in runs.items():
                    i = rep % copies
                    start = time.perf_counter()
                    fn(i)
                    times[key].append(1e3 * (time.perf_counter() - start))
            ref = ((x.double() @ ws[0].double().t()) * scales.double()).float().bfloat16()
            equal = {key: (fn(0) == ref).float().mean().item() for key, fn in runs.items()}
            a, e = statistics.median(times["avx"]), statistics.median(times["exact"])
            print(f"| {name} {n} x {kk} | {m} | {a:.3f} | {e:.3f} | {a / e:.2f}x | {equal['avx']:.1%} / "
                  f"{equal['exact']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
