"""Embedding throughput: texts/s at a batch of 32 sentences (10-60 words), ember's ``LLM.embed`` against
``SentenceTransformer.encode`` on the same sentence-transformers folder, float32, the same threads, in one process
with the two interleaved repeat by repeat (so both see the same machine load; the order rotates, with a pause
before each run); medians and their ratio. Also the
smallest cosine between each one's vectors and sentence-transformers'. ember runs twice: its default
(``batch_invariant=True``: its fixed-order GEMM) and ``batch_invariant=False`` (oneDNN's GEMMs, GELU fused).

With ``--vllm-python`` (a vLLM-CPU environment's interpreter), vLLM's pooling runner (``LLM(runner="pooling")``,
``embed``) runs in a worker process of that interpreter, its engine bound to the same number of cores, and takes its
turn in the same interleaved loop.

    python benchmarks/embeddings.py --model /tmp/minilm/all-MiniLM-L6-v2 [--batch 32] [--repeats 9] [--threads 2]
        [--vllm-python /path/to/vllm-venv/bin/python] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

WORDS = ("the a of to and in is that for it as with was on be by this are from at or an have not which but they "
         "engine model search query vector sentence meaning text answer question city river music history science "
         "people water light language computer system network market price energy health school family world "
         "quickly slowly often never always between under after before because while although during").split()


def sentences(n: int, low: int = 10, high: int = 60, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "." for _ in range(n)]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def vllm_worker(model: str, batch: int, threads: int) -> None:
    """Run in the vLLM environment: load, warm up, print the vectors; then one timed embed a line read."""
    import os
    import sys

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM as VLLM

    texts = sentences(batch)
    llm = VLLM(model=model, runner="pooling", dtype="float32", max_num_seqs=max(batch, 8), enforce_eager=True)
    vectors = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    print("READY " + json.dumps(vectors), flush=True)
    for _ in sys.stdin:
        t = time.perf_counter()
        llm.embed(texts, use_tqdm=False)
        print(f"TIME {time.perf_counter() - t}", flush=True)


class VLLMProcess:
    """The vLLM worker, driven line by line."""

    def __init__(self, python: str, model: str, batch: int, threads: int) -> None:
        self.proc = subprocess.Popen([python, __file__, "--vllm-worker", "--model", model, "--batch", str(batch),
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.vectors = json.loads(self._line("READY "))

    def _line(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"the vLLM worker exited ({self.proc.wait()}) before printing {prefix!r}")

    def run(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._line("TIME "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a sentence-transformers folder (all-MiniLM-L6-v2)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", help="a vLLM-CPU environment's python: time its pooling runner too")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.vllm_worker:
        vllm_worker(args.model, args.batch, args.threads)
        return
    if args.batch < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--batch, --repeats and --threads must be >= 1")

    import torch
    from sentence_transformers import SentenceTransformer

    from ember import LLM

    torch.set_num_threads(args.threads)
    texts = sentences(args.batch)
    st = SentenceTransformer(args.model, device="cpu")
    engines = {invariant: LLM(args.model, dtype="float32", max_num_seqs=max(args.batch, 8), num_threads=args.threads,
                              batch_invariant=invariant) for invariant in (True, False)}

    def ember(invariant: bool):
        return lambda: torch.tensor([o.outputs.embedding for o in engines[invariant].embed(texts)])

    run_ember, run_fast = ember(True), ember(False)

    def run_st():
        return st.encode(texts, batch_size=args.batch, convert_to_tensor=True)

    ours, theirs = run_ember(), run_st()  # warm-up, and the agreement figure

    def min_cos(vectors: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(vectors.double(), theirs.double()).min().item()

    fast = "ember (batch_invariant=False)"
    cos = {"ember": min_cos(ours), fast: min_cos(run_fast())}
    runs = [("ember", run_ember), (fast, run_fast), ("sentence-transformers", run_st)]
    vllm = None
    if args.vllm_python:
        vllm = VLLMProcess(args.vllm_python, args.model, args.batch, args.threads)
        cos["vllm"] = min_cos(torch.tensor(vllm.vectors))
        runs.append(("vllm", vllm.run))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in range(args.repeats):
        for name, fn in runs[r % len(runs):] + runs[:r % len(runs)]:  # each takes each place in turn
            time.sleep(0.3)  # the previous one's idle threads (vLLM's OpenMP ones spin) settle first
            t = time.perf_counter()
            took = fn()
            times[name].append(took if isinstance(took, float) else time.perf_counter() - t)
    for llm in engines.values():
        llm.shutdown()
    if vllm is not None:
        vllm.close()
    rate = {k: args.batch / statistics.median(v) for k, v in times.items()}
    result = {"model": args.model, "cpu": cpu_name(), "threads": args.threads, "batch": args.batch,
              "repeats": args.repeats, "dtype": "float32", "texts_per_s": rate,
              "ratio": {f"{a} / {b}": rate[a] / rate[b] for a in ("ember", fast) for b in rate
                        if not b.startswith("ember")},
              "min_cosine": cos,
              "seconds": times, "tokens": sum(len(st.tokenizer(t)["input_ids"]) for t in texts)}
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
