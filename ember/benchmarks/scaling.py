"""``ember bench scaling``: output tokens/s as the load grows, one engine a point, all requests at once.

Two sweeps, each point its own process (the engine sized for it), the backends and repeats interleaved as the other
modes run them:
- concurrency: ``c`` requests in flight at most (the engine's ``max_num_seqs``), max(c, 8) requests of
  ``--prompt-len`` random tokens and ``--output-len`` outputs;
- prompt length: ``--requests-per-len`` requests of each length, all in flight, ``--output-len`` outputs.
The record keeps every run; the chart draws both curves (log-2 x axes), the table gives the medians with each
point's speed-up over the previous one, where a curve bends shows first.
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("ember.bench")

# engines that batch (max_num_seqs)
SCALING_BACKENDS = ("ember", "ember-float", "ember-int8", "ember-w8a8", "ember-variant", "vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256",
                   help="requests in flight at most, comma separated (each point: max(c, 8) requests)")
    p.add_argument("--prompt-lens", default="128,256,512,1024,2048,4096,8064",
                   help="prompt lengths of the second sweep, comma separated (a prompt and its output must fit the "
                        "model's context: SmolLM2's 8192 holds 8064 + 128)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of the concurrency sweep")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of every request")
    p.add_argument("--requests-per-len", type=int, default=8, help="requests of each prompt length, all in flight")


def check_backends(backends: list[str]) -> None:
    """Before anything runs: every backend batches requests (llama.cpp and transformers here do not)."""
    unsupported = [b for b in backends if b not in SCALING_BACKENDS]
    if unsupported:
        raise ValueError(f"--backends {','.join(unsupported)}: scaling runs engines that batch, one of "
                         f"{', '.join(SCALING_BACKENDS)}")


def _ints(text: str, flag: str) -> list[int]:
    """A flag's comma-separated positive integers, each once."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected positive integers, comma separated") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"{flag}={text!r}: expected positive integers, comma separated, each once")
    return values


def points(args: argparse.Namespace, vocab: list[int]) -> list[tuple[str, int, list, dict]]:
    """(sweep, value, requests, engine options) of every point, in sweep order."""
    from ember.benchmarks.workloads import fixed_requests

    if args.output_len < 1 or args.prompt_len < 1 or args.requests_per_len < 1:
        raise ValueError(f"--prompt-len={args.prompt_len}, --output-len={args.output_len} and --requests-per-len="
                         f"{args.requests_per_len} must be >= 1")
    out = []
    for c in _ints(args.concurrency, "--concurrency"):
        out.append(("concurrency", c, fixed_requests(args.prompt_len, args.output_len, max(c, 8), vocab, args.seed),
                    {"max_num_seqs": c}))
    for n in _ints(args.prompt_lens, "--prompt-lens"):
        out.append(("prompt_len", n, fixed_requests(n, args.output_len, args.requests_per_len, vocab, args.seed),
                    {"max_num_seqs": args.requests_per_len}))
    return out


def run_scaling(args: argparse.Namespace, backends: list[str], model: str, plan: dict, dtypes: dict, options: dict,
                sweep: list[tuple[str, int, list, dict]], record: dict) -> dict:
    """Every point of ``sweep`` (``points``) on every backend, ``args.repeats`` times interleaved; writes the record,
    chart and table to ``args.out``."""
    from ember.benchmarks import metrics
    from ember.benchmarks.runner import EMBER_VARIANTS, run_driver

    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    runs: dict[str, dict[str, dict[str, list[dict]]]] = {}
    versions: dict[str, str] = {}
    for rep in range(args.repeats):
        order = backends[rep % len(backends):] + backends[:rep % len(backends)]
        for kind, value, requests, engine in sweep:
            for b in order:
                python, path = plan[b]
                opts = EMBER_VARIANTS.get(b, {}) | options.get(b, {}) | engine
                spec = {"model": path, "dtype": dtypes[b], "mode": "throughput", "threads": args.threads,
                        "device": args.device, "options": opts,
                        "max_model_len": max(len(r.prompt_token_ids) + r.max_tokens for r in requests),
                        "requests": [r.to_json() for r in requests]}
                log.info("run %d/%d: %s, %s %d", rep + 1, args.repeats, b, kind, value)
                done = run_driver(b, python, spec, os.path.join(args.out, "logs", f"scaling-{kind}-{value}-{b}.log"),
                                  args.timeout)
                versions[b] = done.result.get("backend_version", "")
                fig = metrics.throughput_figures(done.result, done.peak_rss_bytes)
                runs.setdefault(kind, {}).setdefault(str(value), {}).setdefault(b, []).append(fig)
                log.info("  %.1f output tok/s", fig["output_tokens_per_s"])
    median = {kind: {value: {b: metrics.median_figures(rs) for b, rs in per.items()} for value, per in by.items()}
              for kind, by in runs.items()}
    record.update(model=model, prompt_len=args.prompt_len, output_len=args.output_len,
                  requests_per_len=args.requests_per_len, versions=versions, runs=runs, median=median)
    from ember.benchmarks import report

    base = os.path.join(args.out, "scaling")
    report.write_json(record, base + ".json")
    chart = write_chart(record, base + ".png")
    print(table(record))
    print(f"\nwrote {base}.json" + (f" and {base}.png" if chart else ""))
    return record


def table(record: dict) -> str:
    """Markdown: one row a point, each backend's median output tok/s and its ratio to the previous point's."""
    from ember.benchmarks.report import _name

    backends = record["backends"]
    rows = []
    for kind, head in (("concurrency", "requests in flight"), ("prompt_len", "prompt tokens")):
        by = record["median"].get(kind, {})
        if not by:
            continue
        rows += ["", f"| {head} | " + " | ".join(f"{_name(b)} output tok/s (x previous)" for b in backends) + " |",
                 "|---" * (len(backends) + 1) + "|"]
        prev: dict[str, float] = {}
        for value in sorted(by, key=int):
            cells = []
            for b in backends:
                fig = by[value].get(b)
                if fig is None:
                    cells.append("n/a")
                    continue
                v = fig["output_tokens_per_s"]
                cells.append(f"{v:.1f}" + (f" ({v / prev[b]:.2f}x)" if b in prev else ""))
                prev[b] = v
            rows.append(f"| {value} | " + " | ".join(cells) + " |")
    return "\n".join(rows[1:])


def write_chart(record: dict, path: str) -> bool:
    """Output tok/s against concurrency and against prompt length, one line a backend; False without matplotlib."""
    from ember.benchmarks.report import _name, pyplot, save_chart

    plt = pyplot()
    if plt is None:
        return False

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    titles = {"concurrency": (f"requests in flight ({record['prompt_len']}-token prompts)", axes[0]),
              "prompt_len": (f"prompt tokens ({record['requests_per_len']} requests in flight)", axes[1])}
    for kind, (label, ax) in titles.items():
        by = record["median"].get(kind, {})
        xs = sorted(by, key=int)
        for b in record["backends"]:
            pts = [(int(x), by[x][b]["output_tokens_per_s"]) for x in xs if b in by[x]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=_name(b),
                        color="#d9480f" if b == "ember" else None)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel(f"output tokens/s ({record['output_len']} a request, median)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    save_chart(plt, fig, record["machine"], path, f"; {os.path.basename(record['model'])}")
    return True
