"""``ember bench soak``: a bounded long run of ``ember serve`` on 127.0.0.1 under a mixed load, checked for what
only time shows: memory that grows, KV blocks that are never given back, a 5xx, a request that never ends, latency
that drifts.

The server runs in a subprocess on a random-initialised tiny Llama (hidden 64, two layers, the default model's
tokenizer) with two random PEFT adapters written by the soak itself and ``--max-loras 1``: every kind of request
(LoRA swaps included) is possible without downloads, and a step is cheap, so the run is many requests of engine
and server bookkeeping rather than a few of matrix products. ``--model`` serves another checkpoint instead (no
adapters then). ``concurrency`` clients loop over ``soak_load.Kinds``; every ``burst_every`` seconds a burst of
``burst_size`` short requests hits the queue limit (503 is right there). Every ``sample_every`` seconds the server's
RSS (its process and children, from /proc through psutil) and its /metrics gauges are sampled.

At the end the load stops, the server is waited on until idle, and the checks are made: no 5xx but 503, every
answer right for its request (``soak_load.judge``), no hang, KV usage and requests in flight back to zero, RSS
after warm-up grown less than ``rss_limit``, p99 of the last latency window within ``p99_factor`` of the first
after warm-up. The report is JSON (``--out``) and an optional chart (``--chart``); the exit code is 1 when a check
fails. docs/reliability.md holds the method and the 30-minute run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from ember.benchmarks.soak_load import Kinds, Outcome, fire
from ember.benchmarks.soak_report import chart, tables
from ember.errors import ConfigError

READY = re.compile(r"ready on (http://\S+)")
ADAPTERS = ("soak-a", "soak-b")
GAUGES = {"ember_kv_cache_usage_perc": "kv_usage", "ember_num_requests_running": "running",
          "ember_num_requests_waiting": "waiting", "ember_server_requests_in_flight": "in_flight"}


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration: float = 1800.0  # seconds of load
    concurrency: int = 8  # clients of the steady mix
    sample_every: float = 5.0
    window: float = 120.0  # latency window (seconds)
    warmup_frac: float = 0.1  # the first part of the run, left out of the RSS and latency baselines
    burst_every: float = 60.0
    burst_size: int = 0  # 0: twice the server's capacity (running seats + queue)
    rss_limit: float = 0.05
    p99_factor: float = 3.0
    max_num_seqs: int = 8
    max_queue: int = 16
    max_model_len: int = 512
    request_timeout: float = 300.0  # an answer slower than this is a hang
    seed: int = 0
    threads: int = 1  # the server's torch threads (OMP_NUM_THREADS): a tiny model on a shared machine runs best on one
    model: str | None = None  # None: the tiny Llama and its two adapters, written to workdir
    workdir: str | None = None


@dataclass(slots=True)
class Run:
    """What the soak gathered while it ran."""

    start: float
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


def prepare_model(workdir: str) -> tuple[str, dict[str, str]]:
    """The tiny random Llama (the default model's tokenizer and chat template) and two random PEFT adapters."""
    import torch
    import transformers

    from ember.config import default_model_path
    from ember.tokenizer import Tokenizer

    model_dir, gguf = os.path.join(workdir, "tiny-llama"), default_model_path()
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tok = Tokenizer.load(gguf, gguf_file=gguf).hf
        config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=1024, tie_word_embeddings=True,
                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    adapters = {}
    for seed, name in enumerate(ADAPTERS, start=1):
        path = adapters[name] = os.path.join(workdir, name)
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            _save_adapter(model_dir, path, seed)
    return model_dir, adapters


def _save_adapter(model_dir: str, out: str, seed: int) -> None:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise RuntimeError("the soak writes its LoRA adapters with peft: pip install peft (or pass --model)") from e
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
                   ).save_pretrained(out)


class Server:
    """``python -m ember serve`` on 127.0.0.1 in a subprocess; its output kept (the last lines go in the report)."""

    def __init__(self, cmd: list[str], threads: int, timeout: float = 600) -> None:
        import psutil

        self.cmd, self.lines, self.url = cmd, [], ""
        self.tracebacks: list[str] = []  # the exception line of each traceback the server printed
        self._in_traceback = False
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
        self.proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        ready = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, args=(ready,), daemon=True)
        self._pump_thread.start()
        if not ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"ember serve did not get ready in {timeout} s:\n{self.log(40)}")

    def _pump(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:  # keep reading, so the pipe never fills
            self.lines.append(line)
            if line.startswith("Traceback"):
                self._in_traceback = True
            elif self._in_traceback and line.strip() and not line.startswith((" ", "\t")):
                self.tracebacks.append(line.strip())
                self._in_traceback = False
            del self.lines[:-2000]
            m = READY.search(line)
            if m and not self.url:
                self.url = m.group(1).rstrip("/")
                ready.set()
        ready.set()

    def log(self, last: int) -> str:
        return "".join(self.lines[-last:])

    def rss(self) -> int:
        """Resident bytes of the server and every process it started."""
        import psutil

        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:  # the server is gone: the checks fail on what the clients and /metrics saw
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self) -> int | None:
        import psutil

        try:  # a server that already exited has no children left to find
            children = self.proc.children(recursive=True)
            self.proc.terminate()
        except psutil.NoSuchProcess:
            children = []
        try:
            code = self.proc.wait(60)
        except psutil.TimeoutExpired:
            self.proc.kill()
            code = None
        for child in children:
            if child.is_running():
                child.kill()
        self._pump_thread.join(10)  # the output to its end, so the log and the tracebacks are whole
        return code


def server_command(cfg: SoakConfig, model: str, adapters: dict[str, str]) -> list[str]:
    cmd = [sys.executable, "-m", "ember", "serve", model, "--host", "127.0.0.1", "--port", str(_free_port()),
           "--dtype", "float32", "--max-num-seqs", str(cfg.max_num_seqs), "--max-queue", str(cfg.max_queue),
           "--max-model-len", str(cfg.max_model_len), "--served-model-name", "soak", "--seed", str(cfg.seed)]
    if adapters:
        cmd += ["--lora-modules", *(f"{k}={v}" for k, v in adapters.items()), "--max-loras", "1"]
    return cmd


def _free_port() -> int:
    from ember.benchmarks.http import free_port

    return free_port()


def scrape(url: str) -> dict[str, float]:
    """/metrics' gauges of interest (summed over engines) and the finished requests by finish reason."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in GAUGES:
                out[GAUGES[s.name]] = out.get(GAUGES[s.name], 0.0) + s.value
            elif s.name == "ember_request_success_total":
                key = f"finished_{s.labels['finish_reason']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


async def _sampler(server: Server, run: Run, stop: asyncio.Event, every: float) -> None:
    while True:
        await _sample(server, run)
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass


async def _sample(server: Server, run: Run, phase: str = "load") -> dict:
    row = {"t": round(time.monotonic() - run.start, 2), "phase": phase, "rss_bytes": server.rss()}
    try:
        row.update(await asyncio.to_thread(scrape, server.url))
    except OSError as e:
        row["scrape_error"] = str(e)
    row["requests_done"] = len(run.outcomes)
    run.samples.append(row)
    return row


async def _client(url: str, kinds: Kinds, rng: random.Random, run: Run, until: float, timeout: float) -> None:
    while time.monotonic() < until:
        run.outcomes.append(await fire(url, kinds.next(rng), timeout))


async def _bursts(url: str, model: str, rng: random.Random, run: Run, until: float, cfg: SoakConfig,
                  size: int) -> None:
    while True:
        await asyncio.sleep(cfg.burst_every * rng.uniform(0.7, 1.3))
        if time.monotonic() >= until:
            return
        shots = [Kinds.burst(rng, model) for _ in range(size)]
        run.outcomes.extend(await asyncio.gather(*(fire(url, s, cfg.request_timeout) for s in shots)))


async def _drive(server: Server, cfg: SoakConfig, adapters: tuple[str, ...]) -> Run:
    run = Run(time.monotonic())
    until = run.start + cfg.duration
    kinds = Kinds(("soak", *adapters), adapters, cfg.max_model_len)
    size = cfg.burst_size or 2 * (cfg.max_num_seqs + cfg.max_queue)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sampler(server, run, stop, cfg.sample_every))
    tasks = [_client(server.url, kinds, random.Random(cfg.seed * 1000 + i), run, until, cfg.request_timeout)
             for i in range(cfg.concurrency)]
    await asyncio.gather(*tasks, _bursts(server.url, "soak", random.Random(cfg.seed - 1), run, until, cfg, size))
    stop.set()
    await sampler
    await _wait_idle(server, run)
    return run


async def _wait_idle(server: Server, run: Run, timeout: float = 120) -> None:
    """Sample until nothing runs, waits or is in flight (or timeout): the state the KV check reads."""
    deadline = time.monotonic() + timeout
    while True:
        row = await _sample(server, run, "idle")
        busy = any(row.get(k, 1.0) for k in ("running", "waiting", "in_flight"))
        if not busy or time.monotonic() > deadline:
            return
        await asyncio.sleep(1.0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def windows(run: Run, cfg: SoakConfig) -> list[dict]:
    """p50 / p99 latency (seconds) of whole answers of the steady mix, per window of ``cfg.window`` seconds."""
    out = []
    n = max(1, int(cfg.duration // cfg.window))
    for i in range(n):
        lo, hi = i * cfg.window, (i + 1) * cfg.window if i < n - 1 else cfg.duration + cfg.request_timeout
        lat = [o.latency for o in run.outcomes if o.timed and lo <= o.end - run.start < hi]
        out.append({"start_s": lo, "end_s": min(hi, cfg.duration), "requests": len(lat), "p50_s": _pct(lat, 50),
                    "p99_s": _pct(lat, 99)})
    return out


def checks(run: Run, cfg: SoakConfig, wins: list[dict], tracebacks: list[str]) -> dict[str, dict]:
    """Each check: ok, the value found and the limit."""
    codes = Counter(o.status for o in run.outcomes)
    five = {c: k for c, k in codes.items() if c >= 500 and c != 503}
    wrong = [o for o in run.outcomes if not o.ok]
    idle = run.samples[-1]
    warm = cfg.duration * cfg.warmup_frac
    load = [s for s in run.samples if s["phase"] == "load"]
    base = [s["rss_bytes"] for s in load if s["t"] >= warm][:3]
    last = [s["rss_bytes"] for s in load][-3:]
    growth = (statistics.median(last) - statistics.median(base)) / statistics.median(base) if base else None
    steady = [w for w in wins if w["start_s"] >= warm and w["p99_s"] is not None]
    ratio = steady[-1]["p99_s"] / steady[0]["p99_s"] if len(steady) >= 2 else None
    left_streams = sum(1 for o in run.outcomes if o.kind == "abort_stream" and o.left)
    aborted = idle.get("finished_abort", 0.0)
    return {
        "no_5xx_but_503": {"ok": not five, "value": five, "limit": "none"},
        # a stream left after its first events was admitted: its engine request must have ended as "abort"
        "left_streams_aborted": {"ok": aborted >= left_streams, "value": aborted, "limit": f">= {left_streams}"},
        "no_traceback_in_server_log": {"ok": not tracebacks, "value": len(tracebacks), "limit": 0,
                                       "first": tracebacks[:5]},
        "every_answer_right": {"ok": not wrong, "value": len(wrong), "limit": 0,
                               "first": [f"{o.kind}: {o.problem}" for o in wrong[:5]]},
        "kv_usage_back_to_zero": {"ok": idle.get("kv_usage") == 0.0, "value": idle.get("kv_usage"), "limit": 0},
        "nothing_in_flight_at_end": {"ok": all(idle.get(k) == 0.0 for k in ("running", "waiting", "in_flight")),
                                     "value": {k: idle.get(k) for k in ("running", "waiting", "in_flight")},
                                     "limit": 0},
        "rss_growth_after_warmup": {"ok": growth is not None and growth < cfg.rss_limit, "value": growth,
                                    "limit": cfg.rss_limit},
        "p99_last_over_first_window": {"ok": ratio is not None and ratio <= cfg.p99_factor, "value": ratio,
                                       "limit": cfg.p99_factor},
    }


def summarize(run: Run, cfg: SoakConfig, model: str, adapters: tuple[str, ...], server: Server) -> dict:
    from ember.benchmarks.report import machine

    by_kind: dict[str, Counter] = {}
    for o in run.outcomes:
        by_kind.setdefault(o.kind, Counter())["left" if o.left else str(o.status)] += 1
    wins = windows(run, cfg)
    found = checks(run, cfg, wins, server.tracebacks)
    return {
        "mode": "soak", "machine": machine(), "model": model, "adapters": list(adapters),
        "settings": asdict(cfg), "server_command": server.cmd[1:],
        "requests": len(run.outcomes), "requests_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "requests_by_model": dict(Counter(o.model for o in run.outcomes)),
        "status_codes": {str(k): v for k, v in sorted(Counter(o.status for o in run.outcomes).items())},
        "latency_windows": wins, "samples": run.samples, "checks": found,
        "passed": all(c["ok"] for c in found.values()),
    }


def run_soak(cfg: SoakConfig) -> dict:
    """Start the server, soak it, stop it; the report."""
    with tempfile.TemporaryDirectory(prefix="ember-soak-") as tmp:
        workdir = cfg.workdir or tmp
        if cfg.model:
            model, adapters = cfg.model, {}
        else:
            model, adapters = prepare_model(workdir)
        server = Server(server_command(cfg, model, adapters), cfg.threads)
        try:
            run = asyncio.run(_drive(server, cfg, tuple(adapters)))
            report = summarize(run, cfg, model if cfg.model else "tiny random Llama", tuple(adapters), server)
        finally:
            code = server.stop()
        report["server_exit_code"] = code
        report["server_log_tail"] = server.log(20)
    return report


def add_parser(modes) -> None:
    d = SoakConfig()
    p = modes.add_parser("soak", help="a long mixed load on ember serve: RSS, KV, status codes, p99 over time",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load (default 1800)")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--sample-every", type=float, default=d.sample_every)
    p.add_argument("--window", type=float, default=d.window, help="latency window in seconds")
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--burst-every", type=float, default=d.burst_every)
    p.add_argument("--burst-size", type=int, default=d.burst_size, help="0: twice the server's capacity")
    p.add_argument("--rss-limit", type=float, default=d.rss_limit)
    p.add_argument("--p99-factor", type=float, default=d.p99_factor)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="an answer slower is a hang")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="the server's OMP_NUM_THREADS (default 1)")
    p.add_argument("--model", default=None, help="serve this checkpoint (no adapters) instead of the tiny Llama")
    p.add_argument("--workdir", default=None, help="keep the tiny model and adapters here (default: a temp dir)")
    p.add_argument("--out", default=None, help="the JSON report (e.g. docs/bench/soak-DATE.json)")
    p.add_argument("--chart", default=None, help="a PNG of RSS and latency over time (matplotlib)")
    p.add_argument("--report", default=None, help="no run: print the tables (and draw --chart) of this JSON report")


def config_from(args: argparse.Namespace) -> SoakConfig:
    cfg = SoakConfig(**{k: getattr(args, k) for k in SoakConfig.__dataclass_fields__})
    for name in ("duration", "concurrency", "sample_every", "window", "burst_every", "max_num_seqs",
                 "max_model_len", "request_timeout", "threads"):
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')}={value} is out of range: it must be finite and > 0")
    if not 0 <= cfg.warmup_frac < 1:
        raise ConfigError(f"--warmup-frac={cfg.warmup_frac} is out of range: it must be in [0, 1)")
    return cfg


def main(args: argparse.Namespace) -> int:
    if args.report:
        with open(args.report) as f:
            report = json.load(f)
    else:
        report = run_soak(config_from(args))
    if args.out and not args.report:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.chart:
        chart(report, args.chart)
    print(tables(report))
    return 0 if report["passed"] else 1
