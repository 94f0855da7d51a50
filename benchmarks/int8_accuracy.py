"""How far int8 activations (``int8_activations=True``) move a GGUF model from its float32 self, beside the default
(bf16 activations) and llama.cpp on the same file: docs/int8_activations.md's accuracy table.

Against the file computed in float32 (``dtype="float32"``: its blocks dequantized), per setting: perplexity of the
first 2,048 tokens of tests/data/alice_ch1.txt in windows of 512, the mean |change| of those tokens'
log-probabilities, and greedy agreement over chat prompts (tokens until the first that differs from float32's, of
48). llama.cpp (llama-cpp-python in the harness's ``llamacpp`` environment, if present) scores the same token ids in
a process of its own.

    python benchmarks/int8_accuracy.py --out /tmp/acc_smol.json [--model /tmp/qwen2.5-coder-1.5b-q4_k_m.gguf]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "alice_ch1.txt")
TOKENS, WINDOW, NEW = 2048, 512, 48
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain", "What is 2+2?",
             "Name three primary colours.", "Who wrote Hamlet?", "Explain photosynthesis in one sentence.",
             "What is the boiling point of water?",
             "Give me a synonym for happy.", "How many legs does a spider have?", "What is Python?",
             "Translate 'good morning' into Spanish.", "Write a short poem about the sea.",
             "What is the largest planet?", "Tell me a fun fact about cats.", "What does a CPU do?",
             "List three fruits.", "What is the speed of light?", "Who painted the Mona Lisa?",
             "Summarize the plot of Cinderella.", "What is machine learning?", "Describe a sunset.",
             "What is the capital of Japan?", "How do I make tea?", "What is gravity?"]
SETTINGS = {"float32": {"dtype": "float32"}, "default": {"dtype": "bfloat16"},
            "int8_activations": {"dtype": "bfloat16", "int8_activations": True}}

# llama.cpp's side, run by the llamacpp environment's python: argv = model, ids file, out file
LLAMACPP = r"""
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
model, data, out = sys.argv[1:4]
with open(data) as f:
    d = json.load(f)
llm = Llama(model_path=model, n_ctx=1024, n_batch=512, logits_all=True, n_threads=2, verbose=False)
def end(t):  # every end-of-generation token (Gemma's <end_of_turn> too), as ember stops at all of its EOS ids
    return llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)
def logp(row):
    row = np.asarray(row, dtype=np.float64)
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))
scores = []
for w in d["windows"]:
    llm.reset()
    llm.eval(w)
    scores += [float(logp(llm.scores[j])[w[j + 1]]) for j in range(len(w) - 1)]
greedy = []
for p in d["prompts"]:
    llm.reset()
    llm.eval(p)
    toks = []
    for _ in range(d["new"]):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        toks.append(t)
        if end(t):
            break
        llm.eval([t])
    greedy.append(toks)
with open(out, "w") as f:
    json.dump({"scores": scores, "greedy": greedy}, f)
"""


def run_ember(model: str | None, settings: dict, windows: list[list[int]], prompts: list[list[int]]) -> dict:
    from ember import LLM, SamplingParams

    llm = LLM(model, max_model_len=1024, enable_prefix_caching=False, **settings)
    try:
        outs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scores = [pos[t].logprob for w, o in zip(windows, outs) for t, pos in zip(w[1:], o.prompt_logprobs[1:])]
        gen = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
        return {"quantization": llm.model_info.quantization, "scores": scores,
                "greedy": [list(o.outputs[0].token_ids) for o in gen]}
    finally:
        llm.shutdown()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first that differs; NEW for the same answer (one that stopped early at EOS included)."""
    if a == b:
        return NEW
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summary(run: dict, ref: dict) -> dict:
    s, r = run["scores"], ref["scores"]
    prefix = [common_prefix(a, b) for a, b in zip(run["greedy"], ref["greedy"])]
    return {"perplexity": round(math.exp(-sum(s) / len(s)), 4),
            "mean_abs_logprob_change": round(sum(abs(a - b) for a, b in zip(s, r)) / len(s), 4),
            "greedy_mean_common_prefix": round(sum(prefix) / len(prefix), 1),
            "greedy_same_first_token": sum(p > 0 for p in prefix), "greedy_prompts": len(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--llamacpp-python", default=os.path.join(ROOT, ".bench", "venvs", "llamacpp", "bin", "python"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from ember import LLM
    from ember.benchmarks.perplexity import windows
    from ember.config import default_model_path

    path = args.model or default_model_path()
    llm = LLM(args.model, max_model_len=1024)
    tok = llm.tokenizer
    with open(TEXT, encoding="utf-8") as f:
        ids = tok.encode(f.read())[:TOKENS]
    chat = tok.has_chat_template  # a file without one (Gemma 3 270M's GGUF): the questions as plain text
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               if chat else tok.encode(q) for q in QUESTIONS]
    llm.shutdown()
    wins = windows(ids, WINDOW)
    runs = {name: run_ember(args.model, settings, wins, prompts) for name, settings in SETTINGS.items()}
    if os.path.isfile(args.llamacpp_python):
        with tempfile.TemporaryDirectory() as tmp:
            data, out = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
            with open(data, "w") as f:
                json.dump({"windows": wins, "prompts": prompts, "new": NEW}, f)
            run = subprocess.run([args.llamacpp_python, "-c", LLAMACPP, path, data, out])
            if run.returncode == 0:
                with open(out) as f:
                    runs["llama.cpp"] = json.load(f) | {"quantization": "the file's blocks, Q8 activations"}
            else:  # ember's columns are still worth keeping
                print(f"llama.cpp failed (exit {run.returncode}): its column is left out", file=sys.stderr)
    else:
        print(f"no llama.cpp environment at {args.llamacpp_python}: its column is left out", file=sys.stderr)
    ref = runs["float32"]
    result = {"model": os.path.basename(path), "text": f"{TOKENS} tokens of tests/data/alice_ch1.txt, windows of "
              f"{WINDOW}", "greedy": f"{len(QUESTIONS)} {'chat' if chat else 'plain'} prompts, {NEW} new tokens",
              "reference": "float32 (the file's blocks dequantized)",
              "settings": {name: {"quantization": run["quantization"]} | summary(run, ref)
                           for name, run in runs.items()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in result["settings"].items():
        print(f"{name:18s} ppl {s['perplexity']:.4f}  mean |d logprob| {s['mean_abs_logprob_change']:.4f}  greedy "
              f"prefix {s['greedy_mean_common_prefix']:.1f} / {NEW}, first token {s['greedy_same_first_token']} / "
              f"{s['greedy_prompts']}  ({s['quantization']})")


if __name__ == "__main__":
    main()
