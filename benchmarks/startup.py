"""Start-up as a user meets it: the whole `ember generate PROMPT --max-tokens 8` command on the default model,
interpreter start to exit, after a first run has built the kernels and cached the tokenizer; llama.cpp's one-shot
generation from the same GGUF (llama-cpp-python, as the harness drives it) in the same run as the baseline.

    python benchmarks/startup.py [--trees before=/tmp/before after=.] [--model M.gguf] [--repeats 7] [--out F.json]

Each repeat runs every tree's command (``python -m ember`` with that tree first on PYTHONPATH) and then llama.cpp's,
one process each, so all see the same machine state; the figures are medians over the repeats. Bytecode is
written (PYTHONDONTWRITEBYTECODE unset), as on a user's machine after the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
_LLAMA_CPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)
print(llm(sys.argv[2], max_tokens=8, temperature=0.0)["choices"][0]["text"])
"""


def _timed(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="*", default=[ROOT],
                   help="ember source trees to time, each PATH or LABEL=PATH (default: this one)")
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--llamacpp-python", default=os.path.join(ROOT, ".bench", "venvs", "llamacpp", "bin", "python"),
                   help="the llama.cpp environment's interpreter (benchmarks/setup_baselines.sh llamacpp); "
                        "missing: no baseline")
    p.add_argument("--out", default=None, help="write the times as JSON here")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from ember.benchmarks.report import machine
    from ember.config import default_model_path

    model = args.model or default_model_path()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    commands = {}
    for item in args.trees:
        label, _, tree = item.rpartition("=")
        label = label or f"ember ({tree})"
        tree_env = dict(env, PYTHONPATH=os.pathsep.join(x for x in (os.path.abspath(tree), env.get("PYTHONPATH"))
                                                        if x))
        # from the tree: ``-m`` puts the working folder first on sys.path
        commands[label] = ([sys.executable, "-m", "ember", "generate", PROMPT, "--max-tokens", "8", "--model", model],
                           tree_env, os.path.abspath(tree))
    if os.path.isfile(args.llamacpp_python):
        commands["llama.cpp"] = ([args.llamacpp_python, "-c", _LLAMA_CPP, model, PROMPT], env, ROOT)
    for command in commands.values():  # the first run builds kernels, caches the tokenizer, writes bytecode
        _timed(*command)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, command in commands.items():
            times[name].append(_timed(*command))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, m in median.items():
        ratio = f", {m / median['llama.cpp']:.2f}x llama.cpp's time" if "llama.cpp" in median and name != "llama.cpp" \
            else ""
        print(f"{name}: {m:.3f} s median of {args.repeats} ({min(times[name]):.3f}-{max(times[name]):.3f}){ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": f"generate {PROMPT!r} --max-tokens 8", "command_line": " ".join(sys.argv),
                       "model": os.path.basename(model),
                       "machine": machine(),
                       "repeats": args.repeats, "times_s": times, "median_s": median}, f, indent=1)


if __name__ == "__main__":
    main()
