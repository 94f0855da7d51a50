"""llama.cpp's own speculative decoding with a draft model: its ``llama-speculative-simple`` example (built by
``setup_baselines.sh llamacpp-draft`` from the llama.cpp of the llamacpp environment), one process a request, on
the very same GGUF files, greedy, EOS not consulted, llama.cpp's own draft settings otherwise (its default: up to 3
tokens a draft, no cut on the draft's own probability; ``--option llamacpp-draft.draft_max=N`` sets
``--spec-draft-n-max``, ``draft_p_min=P`` ``--spec-draft-p-min``). Latency mode only.

The example reads its prompt as text: the request's token ids are detokenized (special tokens kept) and
llama.cpp tokenizes them again, so its prompt count (reported) may differ by a token or two. It prints totals,
not token arrivals: its prompt time ("encoded") and its decode time and token count ("decoded"), and the tokens
it drafted and kept. A request's token times here are its decode time spread evenly
after its prompt time, so the harness's time per output token (a request's decode time over its tokens after the
first) is llama.cpp's own figure; TTFT is its prompt time plus one such share. Model loading is not timed, as in
the other drivers."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

from _common import output_record, run

_FIGURES = {"encoded": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
            "decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds",
            "drafted": r"n_drafted\s*=\s*(\d+)", "accepted": r"n_accept\s*=\s*(\d+)"}


def load(spec: dict) -> dict:
    from llama_cpp import Llama

    opts = spec.get("options", {})
    for key in ("binary", "draft_model"):
        if not os.path.isfile(opts.get(key) or ""):
            raise SystemExit(f"llamacpp-draft: options.{key}={opts.get(key)!r} is not a file")
    vocab = Llama(model_path=spec["model"], vocab_only=True, verbose=False)  # prompt ids -> text, specials kept
    return {"spec": spec, "vocab": vocab}


def _one(engine: dict, r: dict) -> dict:
    spec, opts = engine["spec"], engine["spec"]["options"]
    text = engine["vocab"].detokenize(r["prompt_token_ids"], special=True).decode("utf-8", errors="replace")
    threads = str(spec.get("threads") or os.cpu_count())
    ctx = str(max(spec["max_model_len"], 512))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
    try:
        cmd = [opts["binary"], "-m", spec["model"], "-md", opts["draft_model"], "--spec-type", "draft-simple",
               "-f", f.name, "-n", str(r["max_tokens"]), "--temp", "0", "--ignore-eos", "-t", threads, "-tb", threads,
               "-td", threads, "-c", ctx, "-b", ctx]
        for key, flag in (("draft_max", "--spec-draft-n-max"), ("draft_p_min", "--spec-draft-p-min")):
            if opts.get(key) is not None:
                cmd += [flag, str(opts[key])]
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    finally:
        os.unlink(f.name)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"llamacpp-draft: {' '.join(cmd)} exited with {proc.returncode}:\n{log[-3000:]}")
    return parse(log)


def parse(log: str) -> dict:
    """The output record of one run from the example's printed totals (token times spread as the module says)."""
    found = {k: re.search(p, log) for k, p in _FIGURES.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise SystemExit(f"llamacpp-draft: no {missing} figures in the example's output:\n{log[-3000:]}")
    prompt_s = float(found["encoded"].group(2))
    n, decode_s = int(found["decoded"].group(1)), float(found["decoded"].group(2))
    times = [prompt_s + decode_s * (i + 1) / n for i in range(n)]
    out = output_record(int(found["encoded"].group(1)), n, times)  # the prompt as llama.cpp tokenized its text
    out.update(draft_tokens=int(found["drafted"].group(1)), accepted_draft_tokens=int(found["accepted"].group(1)))
    return out


def latency(engine: dict, spec: dict) -> dict:
    outputs, start = [], time.perf_counter()
    for r in spec["requests"]:
        outputs.append(_one(engine, r))
    return {"wall_s": time.perf_counter() - start, "outputs": outputs}


def _version(engine_binary: str) -> str:
    proc = subprocess.run([engine_binary, "--version"], capture_output=True, text=True, errors="replace")
    line = next((x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("version")), "version unknown")
    return f"llama.cpp llama-speculative-simple ({line.strip()})"


if __name__ == "__main__":
    import json
    import sys

    with open(sys.argv[1]) as f:
        binary = json.load(f).get("options", {}).get("binary", "")
    run(load, {"latency": latency}, _version(binary) if os.path.isfile(binary) else "llama.cpp (not built)")
