"""ember against ember: the same benchmarks run from two source trees, interleaved, in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/compare_trees.py /tmp/before . --repeats 3 [--bench-args "--model M.gguf --dtype float32"]

Each repeat runs, for each tree in turn, `ember bench throughput --workload W1` and `ember bench latency` (batch 1)
with that tree first on PYTHONPATH, so both see the same machine state; medians and after/before ratios come out
as a table (and JSON with --out). The same tree twice with ``--after-env NAME=VALUE`` compares a setting instead
(the engine core on a thread against its own process: ``. . --after-env EMBER_ENGINE_CORE_PROCESS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_tree(tree: str, mode: str, out: str, extra: list[str], env_extra: dict[str, str] | None = None) -> dict:
    # the tree first; what was on PYTHONPATH (packages installed with --target) stays behind it
    path = os.pathsep.join(p for p in (os.path.abspath(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, **(env_extra or {}))
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "bench", mode, "--backends", "ember", "--repeats", "1",
           "--out", out, *extra]
    subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), check=True, stdout=subprocess.DEVNULL)
    name = "throughput-W1.json" if mode == "throughput" else "latency.json"
    with open(os.path.join(out, name)) as f:
        return json.load(f)["runs"]["ember"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-runs", type=int, default=3)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--bench-args", default="", help="more arguments of both benchmarks (model, dtype, threads)")
    p.add_argument("--modes", default="throughput,latency",
                   help="which benchmarks each repeat runs (`latency` alone: batch-1 decode of a large model)")
    p.add_argument("--after-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable set for the 'after' runs only (repeatable)")
    args = p.parse_args()
    after_env = dict(kv.split("=", 1) for kv in args.after_env)
    trees = {"before": args.before, "after": args.after}
    figures: dict[str, dict[str, list[float]]] = {t: {"w1": [], "b1_32": [], "b1_512": [], "ttft_512": []}
                                                  for t in trees}
    extra = args.bench_args.split()
    modes = set(args.modes.split(","))
    if not modes or modes - {"throughput", "latency"}:
        p.error(f"--modes takes throughput and / or latency, got {args.modes!r}")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, tree in trees.items():
                out = os.path.join(tmp, f"{name}-{r}")
                env = after_env if name == "after" else None
                said = [f"repeat {r + 1} {name}:"]
                if "throughput" in modes:
                    w1 = run_tree(tree, "throughput", out, ["--workload", "W1", *extra], env)
                    figures[name]["w1"].append(w1["output_tokens_per_s"])
                    said.append(f"W1 {w1['output_tokens_per_s']:.1f} out tok/s")
                if "latency" in modes:
                    lat = run_tree(tree, "latency", out, ["--runs", str(args.latency_runs), *extra], env)
                    figures[name]["b1_32"].append(lat["prompt_32"]["decode_tokens_per_s"])
                    figures[name]["b1_512"].append(lat["prompt_512"]["decode_tokens_per_s"])
                    figures[name]["ttft_512"].append(lat["prompt_512"]["ttft_ms_median"])
                    said.append(f"batch-1 decode {lat['prompt_32']['decode_tokens_per_s']:.1f} / "
                                f"{lat['prompt_512']['decode_tokens_per_s']:.1f} tok/s (prompt 32 / 512)")
                print(" ".join(said), flush=True)
    print("\n| figure | before (median) | after (median) | after / before |\n|---|---|---|---|")
    for key, label in (("w1", "W1 output tok/s"), ("b1_32", "batch-1 decode tok/s, prompt 32"),
                       ("b1_512", "batch-1 decode tok/s, prompt 512"), ("ttft_512", "TTFT ms, prompt 512")):
        if not figures["before"][key]:
            continue
        b, a = statistics.median(figures["before"][key]), statistics.median(figures["after"][key])
        runs = [", ".join(f"{x:.1f}" for x in figures[t][key]) for t in ("before", "after")]
        print(f"| {label} | {b:.1f} ({runs[0]}) | {a:.1f} ({runs[1]}) | {a / b:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": trees, "after_env": after_env, "figures": figures, "command": " ".join(sys.argv)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
