"""``ember serve``: load the engine, serve the app with uvicorn, print the readiness line, and on SIGINT / SIGTERM
abort every request in flight (their streams end with finish_reason "abort"), let uvicorn close the connections,
then stop the engine (and its ranks)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys

import uvicorn

from ember import envs
from ember.config import EngineConfig, default_model_path, hub
from ember.errors import ConfigError
from ember.frontend.client import start_client
from ember.lora.adapter import lora_settings
from ember.lora.request import LoRARequest
from ember.server.app import ServedModel, ServerSettings, build_app


def _names(args: argparse.Namespace, model: str | None) -> tuple[str, ...]:
    if args.served_model_name:
        return tuple(args.served_model_name)
    if model and not os.path.exists(os.path.expanduser(model)) and hub.is_hub_id(model):
        return (model,)  # a hub id is the model's name, as clients spell it ("org/name")
    path = os.path.normpath(model or default_model_path())
    name = os.path.basename(path)
    for suffix in (".gguf", ".asmodel"):
        name = name.removesuffix(suffix)
    return (name,)


def _settings(args: argparse.Namespace, model: str | None) -> ServerSettings:
    for flag, value, low in (("--port", args.port, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1),
                             ("--max-stored-responses", args.max_stored_responses, 0),
                             ("--max-stored-response-bytes", args.max_stored_response_bytes, 0),
                             ("--max-engine-restarts", args.max_engine_restarts, 0)):
        if value < low or (flag == "--port" and value > 65535):
            raise ConfigError(f"{flag}={value} is out of range: it must be >= {low}"
                              + (" and <= 65535" if flag == "--port" else ""))
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    return ServerSettings(api_key=args.api_key or envs.api_key(), max_queue=args.max_queue,
                          max_request_bytes=args.max_request_bytes, allowed_origins=origins,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          max_stored_responses=args.max_stored_responses,
                          max_stored_response_bytes=args.max_stored_response_bytes,
                          max_engine_restarts=args.max_engine_restarts)


def lora_modules(specs: list[str] | None) -> tuple[LoRARequest, ...]:
    """--lora-modules as vLLM reads it: NAME=PATH, or a JSON object with "name" and "path"; ids 1, 2, ..."""
    loras = []
    for spec in specs or []:
        if "=" in spec and not spec.lstrip().startswith("{"):
            name, _, path = spec.partition("=")
        else:
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (ValueError, TypeError, KeyError):
                raise ConfigError(f"--lora-modules {spec!r} is not NAME=PATH or a JSON object with \"name\" and "
                                  "\"path\"") from None
        loras.append(LoRARequest(name.strip(), len(loras) + 1, os.path.expanduser(path.strip())))
    return tuple(loras)


def serve(args: argparse.Namespace) -> int:
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ValueError(f"MODEL={args.model_arg!r} and --model={args.model!r} differ: give one")
    model = args.model_arg or args.model
    loras = lora_modules(args.lora_modules)
    lora = lora_settings([r.lora_path for r in loras], args.max_loras, args.max_lora_rank) if loras else {}
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                          int8_activations=args.int8_activations, calibration_data=args.calibration,
                          kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          distributed_executor_backend=args.distributed_executor_backend,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_prefill_seqs=args.max_num_prefill_seqs,
                          enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                          speculative_config=args.speculative_config, limit_mm_per_prompt=args.limit_mm_per_prompt,
                          allowed_local_media_path=args.allowed_local_media_path,
                          allowed_media_domains=args.allowed_media_domains, **lora)
    settings, names = _settings(args, model), _names(args, model)  # checked before the model loads
    _raise_open_files()
    print(f"[ember] loading {model or default_model_path()} ...", file=sys.stderr, flush=True)
    client = start_client(config)
    try:
        for r in loras:  # checked against the model now; the first max_loras are loaded before serving
            client.add_lora(r)
        restart = functools.partial(start_client, config)  # the same engine again, should its loop stop
        run_app([ServedModel(names, client, loras, restart)], settings, args.host, args.port,
                access_log=args.access_log)
    finally:
        client.shutdown()
    print("[ember] server stopped", file=sys.stderr, flush=True)
    return 0


def run_app(models: list[ServedModel], settings: ServerSettings, host: str, port: int, access_log: bool = False,
            log_level: str = "warning") -> None:
    """Serve the engines until SIGINT / SIGTERM: print the readiness line once requests are accepted; on the signal
    abort every request in flight and close the server. The engines stay up (their owner stops them)."""
    app = build_app(models, settings)
    state = app.state.ember
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                    timeout_graceful_shutdown=10, timeout_keep_alive=30), state.abort_all)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    info = models[0].client.model_info
    served = ", ".join(m.names[0] for m in models)
    # uvicorn raises the signal it handled again once its own shutdown is done; a no-op handler lets the caller
    # go on (stop the engine and its ranks) instead of the process dying at that point
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(_serve(server, f"[ember] serving {served} (max_model_len {info.max_model_len}, "
                                   f"{info.max_num_seqs} seqs, queue {settings.max_queue}"
                                   f"{', API key required' if settings.api_key else ''}): ready on {url}"))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
