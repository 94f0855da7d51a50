"""Runs one backend driver in its own process (and virtual environment) and watches its memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ember import envs

BACKENDS = ("ember", "ember-float", "ember-int8", "ember-w8a8", "ember-json", "ember-lora", "ember-eager",
            "ember-variant", "ember-a8", "ember-ngram", "ember-suffix", "ember-prediction", "ember-draft",
            "ember-json-ngram", "hf", "vllm", "llamacpp", "llamacpp-draft")
BACKEND_NAMES = {"ember": "ember", "ember-float": "ember (float weights)",
                 "ember-int8": "ember (int8, bf16 activations)", "ember-w8a8": "ember (w8a8)",
                 "ember-json": "ember (JSON-schema guided)",
                 "ember-lora": "ember (4 LoRA adapters mixed)", "ember-eager": "ember (no CUDA graphs)",
                 "ember-variant": "ember (batch_invariant=False)", "ember-a8": "ember (int8 activations)",
                 "ember-ngram": "ember (n-gram speculation)",
                 "ember-suffix": "ember (suffix decoding)", "ember-prediction": "ember (predicted outputs)",
                 "ember-draft": "ember (draft-model speculation)",
                 "ember-json-ngram": "ember (JSON-schema guided, n-gram speculation)",
                 "hf": "transformers", "vllm": "vLLM-CPU",
                 "llamacpp": "llama.cpp", "llamacpp-draft": "llama.cpp (draft-model speculation)"}
# variants of ember's own driver: the engine arguments they add (the default keeps a GGUF's quantized blocks)
# ("guided_json": every request's reply follows that JSON schema: structured output's cost on the same workload;
# "lora_adapters": that many random rank-16 adapters on every projection, the requests spread over them in turn)
GUIDED_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["title", "year", "tags"]}
EMBER_VARIANTS = {"ember": {}, "ember-float": {"quantization": "none"}, "ember-int8": {"quantization": "int8"},
                  "ember-w8a8": {"quantization": "w8a8"},
                  "ember-json": {"guided_json": GUIDED_SCHEMA},
                  "ember-lora": {"lora_adapters": 4}, "ember-eager": {"enforce_eager": True},
                  "ember-variant": {"batch_invariant": False}, "ember-a8": {"int8_activations": True},
                  "ember-ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 8}},
                  "ember-suffix": {"speculative_config": {"method": "suffix"}},  # vLLM's defaults: up to 24 tokens
                  # requests that carry a prediction send it (no speculative_config: predictions draft anyway)
                  "ember-prediction": {"predictions": True},
                  "ember-draft": {},  # its speculative_config names --draft-model
                  "ember-json-ngram": {"guided_json": GUIDED_SCHEMA,
                                       "speculative_config": {"method": "ngram", "num_speculative_tokens": 8}}}
DRIVERS = os.path.join(os.path.dirname(__file__), "drivers")
DEFAULT_VENVS = envs.bench_venvs()


class BenchError(RuntimeError):
    """A backend could not be run (missing environment, wrong model format, a crash): says which and why."""


@dataclass(slots=True)
class DriverRun:
    result: dict
    peak_rss_bytes: int


def parse_backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise ValueError(f"--backends={text!r}: choose from {', '.join(BACKENDS)} (comma separated)")
    return list(dict.fromkeys(names))


def backend_python(backend: str, venvs: str = DEFAULT_VENVS, overrides: dict[str, str] | None = None) -> str:
    """The interpreter of the backend's environment: ember runs in this one, the baselines in their own."""
    if overrides and backend in overrides:
        return overrides[backend]
    if backend in EMBER_VARIANTS:
        return sys.executable
    if backend == "llamacpp-draft":  # llama.cpp's speculative binary, driven from the llamacpp environment
        if not os.path.isfile(speculative_binary(venvs)):
            raise BenchError(f"backend 'llamacpp-draft' has no build at {os.path.join(venvs, backend)}: run "
                             "`benchmarks/setup_baselines.sh llamacpp-draft` first")
        backend = "llamacpp"
    python = os.path.join(venvs, backend, "bin", "python")
    if not os.path.isfile(os.path.join(venvs, backend, ".installed")):
        raise BenchError(f"backend {backend!r} has no environment at {os.path.join(venvs, backend)}: "
                         f"run `benchmarks/setup_baselines.sh {backend}` first (or pass --python {backend}=PATH)")
    return python


def speculative_binary(venvs: str = DEFAULT_VENVS) -> str:
    """llama.cpp's ``llama-speculative-simple``, as ``setup_baselines.sh llamacpp-draft`` builds it."""
    return os.path.join(venvs, "llamacpp-draft", "build", "bin", "llama-speculative-simple")


def run_driver(backend: str, python: str, spec: dict, log_path: str, timeout: float | None = None) -> DriverRun:
    """Run ``drivers/run_<backend>.py`` on ``spec``; the peak resident memory of its process tree comes back too."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        driver = "ember" if backend in EMBER_VARIANTS else backend.replace("-", "_")
        cmd = [python, os.path.join(DRIVERS, f"run_{driver}.py"), spec_path, result_path]
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = psutil.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            peak = watch_rss(proc)
            try:
                code = proc.wait(timeout)
            except psutil.TimeoutExpired:
                proc.kill()
                raise BenchError(f"backend {backend!r} ran past --timeout={timeout}s (log: {log_path})") from None
        if code != 0 or not os.path.isfile(result_path):
            raise BenchError(f"backend {backend!r} failed with exit code {code}; the end of its log "
                             f"({log_path}):\n{_tail(log_path)}")
        with open(result_path) as f:
            return DriverRun(json.load(f), peak())


def watch_rss(proc) -> "callable":
    """Sample the resident memory of the process and its children every 50 ms until it exits."""
    import psutil

    peak = [0]

    def loop() -> None:
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            try:
                procs = [proc, *proc.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def result() -> int:
        thread.join(timeout=1)
        return peak[0]

    return result


def _tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
