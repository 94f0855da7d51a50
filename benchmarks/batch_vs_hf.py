"""Output tokens/s of one batch of requests: ember against transformers ``generate`` in the same process and run.

Every backend gets the identical prompts (chat-formatted questions, token counts vary) and generates exactly
--max-tokens tokens each (EOS ignored). transformers runs them as one static batch with left padding. Each run is a
fresh subprocess (one backend per process: two torch thread pools in one process slow each other down); runs
alternate between backends and repeat; the median is reported, with the ratio ember / transformers.

    python benchmarks/batch_vs_hf.py --requests 32 --max-tokens 128 --dtype bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in simple terms.",
             "Write a short poem about the sea.", "How do I reverse a list in Python?",
             "Why is the sky blue?", "Give me three tips for better sleep.",
             "Summarize the plot of Romeo and Juliet.", "What is the difference between a virus and a bacterium?"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + (" Please answer in detail." * (i % 4))
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def run_ember(llm, batch, max_tokens: int) -> float:
    from ember import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_hf(model, batch, max_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(batch) / elapsed


def measure(backend: str, n: int, max_tokens: int, dtype_name: str) -> float:
    from ember.config import default_model_path
    from ember.tokenizer import Tokenizer

    path = default_model_path()
    batch = prompts(Tokenizer.load(path, gguf_file=path).hf, n)
    if backend == "ember":
        from ember import LLM

        llm = LLM(path, dtype=dtype_name, max_num_seqs=max(64, n), max_model_len=2048)
        run_ember(llm, batch[:2], 4)  # warm-up
        result = run_ember(llm, batch, max_tokens)
        llm.shutdown()
        return result
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=getattr(torch, dtype_name)).eval()
    pad = hf.config.eos_token_id
    run_hf(hf, batch[:2], 4, pad)
    return run_hf(hf, batch, max_tokens, pad)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=["ember", "transformers"], help="measure one backend in this process")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.backend:
        print(json.dumps({"tok_s": measure(args.backend, args.requests, args.max_tokens, args.dtype)}))
        return
    figures: dict[str, list[float]] = {"ember": [], "transformers": []}
    for _ in range(args.repeats):
        for backend in figures:
            cmd = [sys.executable, __file__, "--backend", backend, "--requests", str(args.requests),
                   "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            figures[backend].append(json.loads(out.strip().splitlines()[-1])["tok_s"])
    med = {k: statistics.median(v) for k, v in figures.items()}
    report = {"requests": args.requests, "max_tokens": args.max_tokens, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "runs": figures, "median_tok_s": med,
              "ratio_ember_over_transformers": med["ember"] / med["transformers"]}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
