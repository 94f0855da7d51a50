"""``ember serve``: load the engine, serve the app with uvicorn, print the readiness line, and on SIGINT / SIGTERM
abort every request in flight (their streams end with finish_reason "abort"), let uvicorn close the connections,
then stop the engine (and its ranks)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import uvicorn

from ember import envs
from ember.config import EngineConfig, default_model_path
from ember.errors import ConfigError
from ember.frontend.client import EngineClient
from ember.server.app import ServerSettings, build_app


def _names(args: argparse.Namespace, model: str | None) -> tuple[str, ...]:
    if args.served_model_name:
        return tuple(args.served_model_name)
    path = os.path.normpath(model or default_model_path())
    name = os.path.basename(path)
    for suffix in (".gguf", ".asmodel"):
        name = name.removesuffix(suffix)
    return (name,)


def _settings(args: argparse.Namespace, model: str | None) -> ServerSettings:
    for flag, value, low in (("--port", args.port, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1)):
        if value < low or (flag == "--port" and value > 65535):
            raise ConfigError(f"{flag}={value} is out of range: it must be >= {low}"
                              + (" and <= 65535" if flag == "--port" else ""))
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    return ServerSettings(served_model_names=_names(args, model), api_key=args.api_key or envs.api_key(),
                          max_queue=args.max_queue, max_request_bytes=args.max_request_bytes,
                          allowed_origins=origins)


def serve(args: argparse.Namespace) -> int:
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"MODEL={args.model_arg!r} and --model={args.model!r} differ: give one")
    model = args.model_arg or args.model
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                          calibration_data=args.calibration, kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          distributed_executor_backend=args.distributed_executor_backend,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_prefill_seqs=args.max_num_prefill_seqs,
                          enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)
    settings = _settings(args, model)  # checked before the model loads
    _raise_open_files()
    print(f"[ember] loading {model or default_model_path()} ...", file=sys.stderr, flush=True)
    client = EngineClient(config)
    try:
        app = build_app(client, settings)
        state = app.state.ember
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                        access_log=args.access_log, timeout_graceful_shutdown=10,
                                        timeout_keep_alive=30), state.abort_all)
        url = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}"
        info = client.model_info
        # uvicorn raises the signal it handled again once its own shutdown is done; catching it here lets the
        # engine (and its ranks) stop next instead of the process dying at that point
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        asyncio.run(_serve(server, f"[ember] serving {settings.served_model_names[0]} (max_model_len "
                                   f"{info.max_model_len}, {info.max_num_seqs} seqs, queue {settings.max_queue}"
                                   f"{', API key required' if settings.api_key else ''}): ready on {url}"))
    finally:
        client.shutdown()
    print("[ember] server stopped", file=sys.stderr, flush=True)
    return 0


def _raise_open_files(want: int = 65536) -> None:
    """Every connection is a file descriptor: lift the soft limit (often 1024) toward the hard one, as vLLM does,
    so that a thousand clients get answers (or 503s) rather than refused connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _serve(server, ready_line: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(ready_line, flush=True)
    await task


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit first aborts the requests in flight, so that streams end at once with "abort"
    instead of holding the shutdown until they finish."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self.on_exit)
        except RuntimeError:  # no loop running yet
            pass
        super().handle_exit(sig, frame)
