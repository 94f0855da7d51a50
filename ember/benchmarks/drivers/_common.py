"""What every backend driver shares. Drivers run in the baseline's own virtual environment, so this file (and the
drivers) import nothing from ember: ``python drivers/<backend>.py SPEC.json RESULT.json``.

Spec: {"model", "dtype", "mode": "throughput" | "latency" | "serving", "requests": [{"prompt_token_ids",
"max_tokens"}], "threads", "max_model_len", "options": {...}}.
Result: {"backend_version", "load_s", "wall_s", "outputs": [{"prompt_tokens", "output_tokens", "token_times"}]}, where
token_times are seconds from the request's start to each output token's arrival (latency and serving modes).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any


def run(load: Callable[[dict], Any], modes: dict[str, Callable[[Any, dict], dict]], version: str) -> None:
    spec_path, result_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["mode"] not in modes:
        raise SystemExit(f"mode {spec['mode']!r} is not supported by this backend (it supports {sorted(modes)})")
    start = time.perf_counter()
    engine = load(spec)
    load_s = time.perf_counter() - start
    result = modes[spec["mode"]](engine, spec)
    result.update(backend_version=version, load_s=load_s)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()
    os._exit(0)  # some engines leave non-daemon threads or child processes behind; the result is written


def package_versions(*names: str) -> str:
    """'name X.Y, name2 Z' for the result's backend_version."""
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
            return f"{name} (not installed)"

    return ", ".join(one(n) for n in names)


def set_threads(n: int | None) -> None:
    """Before torch is imported: the same intra-op thread count for every backend."""
    if n:
        os.environ.setdefault("OMP_NUM_THREADS", str(n))


def warmup_requests(spec: dict) -> list[dict]:
    """Two short requests that touch prefill and decode before timing starts."""
    return [{"prompt_token_ids": r["prompt_token_ids"][:16], "max_tokens": 4} for r in spec["requests"][:2]]


class TokenClock:
    """Arrival times of one request's output tokens, relative to its start."""

    __slots__ = ("start", "times")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []

    def tick(self, n: int = 1) -> None:
        now = time.perf_counter() - self.start
        self.times.extend([now] * n)


def output_record(prompt_tokens: int, output_tokens: int, times: list[float] | None = None) -> dict:
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "token_times": times or []}


async def poisson_arrivals(requests: list[dict], start: Callable[[dict], Awaitable[dict]], rate: float,
                           seed: int) -> dict:
    """One task per request, started with exponential gaps at ``rate`` per second (inf: all at once); the wall
    time from the first start to the last output, and the outputs with their ``start_s`` made relative to it."""
    rng, tasks = random.Random(seed), []
    t0 = time.perf_counter()
    for r in requests:
        tasks.append(asyncio.create_task(start(r)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    outputs = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    for o in outputs:
        o["start_s"] -= t0
    return {"wall_s": wall, "outputs": outputs}
