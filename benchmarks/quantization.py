"""Every quantization mode side by side on one model (default: the embedded SmolLM2-135M-Instruct), in one run:

- perplexity on tests/data/alice_ch1.txt (20 kB of public-domain English; windows of 500 tokens prefilled in
  128-token chunks, so later chunks read the KV cache) and greedy agreement with float32 over the 16 prompts of
  tests/e2e/test_quantization.py, each mode run in float32 activations as the tests do;
- weight bytes (all, and the decoder's linear layers) and KV bytes per token, in the accuracy runs (float32
  activations: the float modes hold fp32 weights and KV, bf16 holds bf16);
- speed with the project's benchmark (``ember bench``'s driver, one process a run, modes interleaved, medians):
  batch-1 decode tokens/s (latency: 32-token prompts, 128 output tokens) and W1 throughput (64 mixed requests),
  in bf16 activations, each as a ratio to bf16 weights;
- the calibrated algorithms (awq, smoothquant): the same figures, plus the seconds calibration takes from scratch
  (``--modes`` picks modes; awq / smoothquant run the layouts and kernels of int4 g128 / w8a8, so their speed is
  theirs).

    python benchmarks/quantization.py --repeats 3 --out docs/bench/quantization.json
    python benchmarks/quantization.py --modes fp32,int4-g128,awq,w8a8,smoothquant --skip-speed \
        --out docs/bench/quantization_calibrated.json [--model /tmp/qwen/qwen.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ember import LLM, SamplingParams
from ember.benchmarks import metrics
from ember.benchmarks.bench import _vocab
from ember.benchmarks.perplexity import perplexity
from ember.benchmarks.runner import run_driver
from ember.benchmarks.workloads import WORKLOADS, build_requests, fixed_requests
from ember.config import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_quantization import MODES, PROMPTS, TEXT, WINDOW, _weight_bytes  # noqa: E402  (one definition of each)

MODES = {**MODES, "awq": dict(quantization="awq"), "smoothquant": dict(quantization="smoothquant")}
CALIBRATED = ("awq", "smoothquant")


def calibration_seconds(model: str, mode: str) -> float:
    """Calibration from scratch (no cache): the float32 model on the shipped text, the algorithm's search."""
    from ember.model_loader import open_checkpoint
    from ember.model_loader.calibrated import calibrate
    from ember.quantization import QuantConfig
    from ember.quantization.calibration import read_calibration_text

    ckpt = open_checkpoint(model)
    start = time.perf_counter()
    calibrate(ckpt, ckpt.hf_config(), QuantConfig.of(mode), read_calibration_text(None))
    return time.perf_counter() - start


def accuracy(model: str, names: list[str]) -> dict[str, dict]:
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    out, base = {}, None
    for name in names:
        kw = MODES[name]
        llm = LLM(model, **(dict(dtype="float32", max_num_seqs=16, max_model_len=512, max_num_batched_tokens=128,
                                 enable_prefix_caching=False) | kw))
        ppl = perplexity(llm, llm.get_tokenizer().encode(text), window=WINDOW)
        greedy = [o.outputs[0].token_ids for o in
                  llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
        total, linear = _weight_bytes(llm)
        kv = llm.model_info.kv_block_bytes // 16
        llm.shutdown()
        if base is None:
            base = (ppl, greedy)
        out[name] = {"perplexity": ppl, "perplexity_vs_fp32": ppl / base[0] - 1,
                     "greedy_agreement": sum(a == b for a, b in zip(greedy, base[1])),
                     "weight_bytes": total, "linear_bytes": linear, "kv_bytes_per_token": kv}
        if name in CALIBRATED:
            out[name]["calibration_s"] = calibration_seconds(model, name)
        print(name, json.dumps(out[name]), flush=True)
    return out


def speed(model: str, repeats: int, out_dir: str, device: str = "cpu", names: list[str] | None = None
          ) -> dict[str, dict]:
    vocab = _vocab(model)
    w1 = [r.to_json() for r in build_requests(WORKLOADS["W1"], vocab, 0)]
    lat = [r.to_json() for r in fixed_requests(32, 128, 3, vocab, 0)]
    names = [n for n in (names or MODES) if n != "fp32"]
    if "bf16" not in names:
        names.insert(0, "bf16")  # the reference of the ratios
    runs: dict[str, dict[str, list]] = {n: {"latency": [], "throughput": []} for n in names}
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            opts = {k: v for k, v in MODES[name].items() if k != "dtype"}
            for mode, reqs in (("latency", lat), ("throughput", w1)):
                max_len = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
                spec = {"model": model, "dtype": "bfloat16", "mode": mode, "threads": os.cpu_count(),
                        "device": device, "max_model_len": max_len, "options": opts, "requests": reqs}
                done = run_driver("ember", sys.executable, spec,
                                  os.path.join(out_dir, "logs", f"quant-{mode}-{name}.log"))
                fig = (metrics.latency_figures if mode == "latency" else metrics.throughput_figures)(
                    done.result, done.peak_rss_bytes)
                runs[name][mode].append(fig["prompt_32"]["decode_tokens_per_s"] if mode == "latency"
                                        else fig["output_tokens_per_s"])
            print(rep, name, {m: v[-1] for m, v in runs[name].items()}, flush=True)
    med = {n: {"decode_tok_s": statistics.median(r["latency"]), "w1_output_tok_s": statistics.median(r["throughput"]),
               "runs": r} for n, r in runs.items()}
    for n in names:
        med[n]["decode_vs_bf16"] = med[n]["decode_tok_s"] / med["bf16"]["decode_tok_s"]
        med[n]["w1_vs_bf16"] = med[n]["w1_output_tok_s"] / med["bf16"]["w1_output_tok_s"]
    return med


def table(acc: dict, spd: dict) -> str:
    if not acc:
        return "\n".join(["| mode | batch-1 decode tok/s (x bf16) | W1 output tok/s (x bf16) |", "|---|---|---|"] + [
            f"| {n} | {s['decode_tok_s']:.1f} ({s['decode_vs_bf16']:.2f}x) | {s['w1_output_tok_s']:.1f} "
            f"({s['w1_vs_bf16']:.2f}x) |" for n, s in spd.items()])
    ref = "bf16" if "bf16" in acc else next(iter(acc))
    bf16_linear = acc[ref]["linear_bytes"] / (1 if ref == "bf16" else 2)  # the float modes other than bf16 hold fp32
    rows = ["| mode | perplexity (vs fp32) | greedy = fp32 | linear weights MiB (x bf16) | KV bytes/token | "
            "batch-1 decode tok/s (x bf16) | W1 output tok/s (x bf16) |", "|---|---|---|---|---|---|---|"]
    for name, a in acc.items():
        linear = a["linear_bytes"]  # in that run's dtype: fp32 for the float modes other than bf16
        s = spd.get(name)
        sp = (f"{s['decode_tok_s']:.1f} ({s['decode_vs_bf16']:.2f}x) | {s['w1_output_tok_s']:.1f} "
              f"({s['w1_vs_bf16']:.2f}x)") if s else "- | -"
        rows.append(f"| {name} | {a['perplexity']:.3f} ({a['perplexity_vs_fp32']:+.2%}) | {a['greedy_agreement']}/16 "
                    f"| {linear / 2**20:.1f} ({linear / bf16_linear:.2f}x) | {a['kv_bytes_per_token']} | {sp} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="docs/bench/quantization.json")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--device", default="cpu", help="where the speed runs go: cpu or cuda")
    p.add_argument("--modes", default=None, help="comma-separated modes (default: all but the calibrated ones); the "
                   f"first is the reference of the accuracy figures; known: {', '.join(MODES)}")
    args = p.parse_args()
    model = os.path.abspath(args.model or default_model_path())
    names = args.modes.split(",") if args.modes else [n for n in MODES if n not in CALIBRATED]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    acc = {} if args.skip_accuracy else accuracy(model, names)
    spd = {} if args.skip_speed else speed(model, args.repeats, os.path.dirname(args.out) or ".", args.device, names)
    with open(args.out, "w") as f:
        json.dump({"model": model, "accuracy": acc, "speed": spd, "command": " ".join(sys.argv)}, f, indent=1)
    print(table(acc, spd))


if __name__ == "__main__":
    main()
