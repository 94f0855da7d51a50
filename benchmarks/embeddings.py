"""Embedding throughput: texts/s at a batch of 32 sentences (10-60 words), ember's ``LLM.embed`` against
``SentenceTransformer.encode`` on the same sentence-transformers folder, float32, the same threads, in one process
with the two interleaved repeat by repeat (so both see the same machine load); medians and their ratio. Also the
smallest cosine between the two's vectors.

    python benchmarks/embeddings.py --model /tmp/minilm/all-MiniLM-L6-v2 [--batch 32] [--repeats 9] [--threads 2]
        [--out result.json]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a sentence-transformers folder (all-MiniLM-L6-v2)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.batch < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--batch, --repeats and --threads must be >= 1")

    import torch
    from sentence_transformers import SentenceTransformer

    from ember import LLM

    torch.set_num_threads(args.threads)
    texts = sentences(args.batch)
    st = SentenceTransformer(args.model, device="cpu")
    llm = LLM(args.model, dtype="float32", max_num_seqs=max(args.batch, 8), num_threads=args.threads)

    def run_ember():
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts)])

    def run_st():
        return st.encode(texts, batch_size=args.batch, convert_to_tensor=True)

    ours, theirs = run_ember(), run_st()  # warm-up, and the agreement figure
    cos = torch.nn.functional.cosine_similarity(ours.double(), theirs.double()).min().item()
    times: dict[str, list[float]] = {"ember": [], "sentence-transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("ember", run_ember), ("sentence-transformers", run_st)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    llm.shutdown()
    rate = {k: args.batch / statistics.median(v) for k, v in times.items()}
    result = {"model": args.model, "cpu": cpu_name(), "threads": args.threads, "batch": args.batch,
              "repeats": args.repeats, "dtype": "float32", "texts_per_s": rate,
              "ratio": rate["ember"] / rate["sentence-transformers"], "min_cosine": cos,
              "seconds": times, "tokens": sum(len(st.tokenizer(t)["input_ids"]) for t in texts)}
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
