"""``ember bench serving --http``: any OpenAI-compatible server driven over HTTP by one client.

Each backend's server (``ember serve``, or ``vllm serve`` from its own environment) is started as a process, the
same client sends the workload's requests to ``/v1/completions`` (token-id prompts, greedy, ignore_eos, streamed)
with Poisson arrivals at ``--rate`` and at most ``--concurrency`` in flight, and records when each streamed token
arrives. The client is a plain asyncio HTTP/1.1 reader (no SDK), so its own cost is small and the same for every
server. ``post`` is also what the server tests use to control exactly when a connection closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field

from ember.benchmarks.drivers._common import poisson_arrivals
from ember.benchmarks.runner import BenchError, DriverRun, watch_rss

SERVED_NAME = "bench"


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""  # the whole body, or what was read before leaving
    events: list[str] = field(default_factory=list)  # the `data:` payloads of an event stream, in order
    event_times: list[float] = field(default_factory=list)  # perf_counter() when each event arrived


async def post(url: str, path: str, payload: dict | bytes, headers: dict[str, str] | None = None,
               leave_after_events: int | None = None, timeout: float = 120,
               declared_length: int | None = None) -> Answer:
    """One POST on its own connection. ``leave_after_events=k`` reads k SSE events and then closes the connection
    (a client that leaves); ``declared_length`` announces a longer body than is sent (a server must answer from the
    header alone)."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
            f"Content-Length: {declared_length or len(data)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    answer = Answer()
    try:
        async with asyncio.timeout(timeout):
            await writer.drain()
            answer.status = int((await reader.readline()).split()[1])
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                answer.headers[k.strip().lower()] = v.strip()
            chunked = answer.headers.get("transfer-encoding") == "chunked"
            pending = b""
            while piece := await (_chunk(reader) if chunked else reader.read(65536)):
                answer.body += piece
                pending += piece
                while b"\n\n" in pending:
                    event, pending = pending.split(b"\n\n", 1)
                    if event.startswith(b"data: "):
                        answer.events.append(event[6:].decode())
                        answer.event_times.append(time.perf_counter())
                if leave_after_events is not None and len(answer.events) >= leave_after_events:
                    break
    finally:
        writer.close()
    return answer


async def _chunk(reader: asyncio.StreamReader) -> bytes:
    """One piece of a chunked body (b"" at its end)."""
    size = int((await reader.readline()).strip() or b"0", 16)
    if size == 0:
        return b""
    return (await reader.readexactly(size + 2))[:-2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(backend: str, python: str, model: str, dtype: str, port: int, max_model_len: int,
                   options: dict) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start one backend's OpenAI-compatible server."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items() if k != "kv_cache_gib"]
    if backend == "ember":
        return ([python, "-m", "ember", "serve", model, "--port", str(port), "--dtype", dtype, "--max-model-len",
                 str(max_model_len), "--served-model-name", SERVED_NAME, *flags], {})
    if backend == "vllm":  # its documented CPU settings: a KV space in GiB; the engine core in its own process
        env = {"VLLM_CPU_KVCACHE_SPACE": str(options.get("kv_cache_gib", 4)), "VLLM_LOGGING_LEVEL": "WARNING"}
        return ([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
                 "--dtype", dtype, "--max-model-len", str(max_model_len), "--served-model-name", SERVED_NAME,
                 "--seed", "0", "--enable-prefix-caching", *flags], env)
    raise BenchError(f"backend {backend!r} has no OpenAI-compatible server here: --http runs ember and vllm")


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the server exited with code {proc.returncode} before it was ready (log: {log_path})")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise BenchError(f"the server was not ready after {timeout} s (log: {log_path})")


def run_server(backend: str, python: str, spec: dict, log_path: str, timeout: float) -> DriverRun:
    """Start the backend's server, drive it with the spec's requests, stop it; peak RSS of its process tree."""
    import psutil

    port = free_port()
    cmd, extra_env = server_command(backend, python, spec["model"], spec["dtype"], port, spec["max_model_len"],
                                    spec.get("options", {}))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **extra_env)
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        start = time.perf_counter()
        proc = psutil.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        peak = watch_rss(proc)
        try:
            _wait_ready(url, proc, timeout, log_path)
            load_s = time.perf_counter() - start
            result = asyncio.run(drive(url, spec["requests"], spec["serving"], timeout))
        finally:
            _stop(proc)
    return DriverRun(result | {"load_s": load_s, "backend_version": _version(backend, python)}, peak())


def _stop(proc) -> None:
    import psutil

    children = proc.children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except psutil.TimeoutExpired:
        proc.kill()
    for child in children:  # an engine process the server started must not outlive it
        if child.is_running():
            child.kill()


def _version(backend: str, python: str) -> str:
    package = {"ember": "ember", "vllm": "vllm-cpu"}[backend]
    code = f"from importlib.metadata import version; print(version({package!r}))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{package} {out or '?'} (server)"


async def drive(url: str, requests: list[dict], opts: dict, timeout: float) -> dict:
    """The requests with Poisson arrivals; per request, when each streamed token arrived (from its send)."""
    gate = asyncio.Semaphore(int(opts["concurrency"]))

    async def one(r: dict) -> dict:
        body = {"model": SERVED_NAME, "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with gate:
            sent = time.perf_counter()
            a = await post(url, "/v1/completions", body, timeout=timeout)
        if a.status != 200:
            raise BenchError(f"the server answered {a.status}: {a.body[:300]!r}")
        times, usage = [], None
        for event, t in zip(a.events, a.event_times):
            if event == "[DONE]":
                continue
            chunk = json.loads(event)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(t - sent)  # one streamed chunk per token (both servers stream token by token)
        n = usage["completion_tokens"] if usage else len(times)
        return {"prompt_tokens": len(r["prompt_token_ids"]), "output_tokens": n, "token_times": times,
                "start_s": sent}

    await one({"prompt_token_ids": requests[0]["prompt_token_ids"][:16], "max_tokens": 4})  # warm the path
    return await poisson_arrivals(requests, one, float(opts["rate"]), opts.get("seed", 0))
