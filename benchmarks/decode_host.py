"""The host's share of a decode step: R sequences at L tokens of context on a tiny random Llama (hidden 64, two
layers, the default model's 49,152-token vocabulary), where the model's own work is small, so what the engine does
around it shows. Public API only, so two source trees compare (``compare_trees.py`` style, ``--trees``).

    python benchmarks/decode_host.py --rows 64 --context 400 [--trees /tmp/before .] [--repeats 3]

Each engine step of S decode steps is timed on the engine thread (``EngineCore.step``), and within it the model's
share (``LlamaForCausalLM.forward`` and ``compute_logits``); host = step - model: scheduling, the step's message,
the inputs' tensors, sampling and the after-step work. Medians over the steps, then over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def make_model(out: str) -> str:
    import torch
    import transformers

    from ember.config import default_model_path
    from ember.tokenizer import Tokenizer

    path = default_model_path()
    hf = Tokenizer.load(path, gguf_file=path).hf
    hf.save_pretrained(out)
    config = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True, bos_token_id=hf.bos_token_id,
                                      eos_token_id=hf.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def measure(model: str, rows: int, context: int, steps: int) -> dict[str, float]:
    import torch

    from ember import LLM, SamplingParams
    from ember.core import engine_core
    from ember.models import llama

    torch.set_num_threads(2)
    in_model = [0.0]
    record: list[tuple[float, float]] = []  # per engine step: (seconds, of which in the model)

    def timed_model(fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                in_model[0] += time.perf_counter() - start
        return wrapper

    step = engine_core.EngineCore.step

    def timed_step(self):
        in_model[0] = 0.0
        start = time.perf_counter()
        try:
            return step(self)
        finally:
            record.append((time.perf_counter() - start, in_model[0]))

    llama.LlamaForCausalLM.forward = timed_model(llama.LlamaForCausalLM.forward)
    llama.LlamaForCausalLM.compute_logits = timed_model(llama.LlamaForCausalLM.compute_logits)
    engine_core.EngineCore.step = timed_step
    llm = LLM(model, dtype="float32", max_num_seqs=rows, max_model_len=context + steps + 8,
              max_num_batched_tokens=max(2048, rows), enable_prefix_caching=False, num_threads=2)
    prompts = [{"prompt_token_ids": [(i * 13 + j) % 40000 + 100 for j in range(context)]} for i in range(rows)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    record.clear()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1 + steps, ignore_eos=True), use_tqdm=False)
    decode = [r for r in record if r[0] > 0][-steps:-1]  # the decode steps (the last one only finishes)
    llm.shutdown()
    return {"rows": rows, "context": context, "steps": len(decode),
            "step_ms": round(1e3 * statistics.median(t for t, _ in decode), 3),
            "model_ms": round(1e3 * statistics.median(m for _, m in decode), 3),
            "host_ms": round(1e3 * statistics.median(t - m for t, m in decode), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: make the tiny random Llama)")
    p.add_argument("--trees", nargs="*", default=None, help="source trees to compare, interleaved (default: this one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single measurement, JSON on stdout
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.rows, args.context, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(os.path.join(tmp, "tiny-llama"))
        trees = args.trees or ["."]
        runs: dict[str, list[dict]] = {t: [] for t in trees}
        for _ in range(args.repeats):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", model, "--rows", str(args.rows),
                       "--context", str(args.context), "--steps", str(args.steps)]
                out = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), check=True, capture_output=True,
                                     text=True).stdout
                runs[tree].append(json.loads(out.strip().splitlines()[-1]))
    summary = {t: {k: statistics.median(r[k] for r in rs) for k in ("step_ms", "model_ms", "host_ms")}
               for t, rs in runs.items()}
    for t, s in summary.items():
        print(f"{t}: step {s['step_ms']:.2f} ms, model {s['model_ms']:.2f} ms, host {s['host_ms']:.2f} ms "
              f"({args.rows} rows, context {args.context}, median of {args.repeats})")
    if len(trees) == 2:
        a, b = (summary[t] for t in trees)
        print(f"after/before: step {b['step_ms'] / a['step_ms']:.2f}, host {b['host_ms'] / a['host_ms']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
