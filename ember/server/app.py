"""The FastAPI application: OpenAI's endpoints (chat, completions, models), vLLM's extras (tokenize, detokenize,
health, metrics) and the chat page, over one ``EngineClient`` or several (one per served model; a request's
``model`` picks its engine).

Every answer other than 200 is an OpenAI error object. Streams are Server-Sent Events; a client that goes away
(mid-stream or while waiting for a non-streamed answer) aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.frontend.client import EngineClient
from ember.lora.request import LoRARequest
from ember.server import embeddings, responses_api
from ember.server import responses as R
from ember.server.admission import Admission
from ember.server.errors import APIError, engine_errors, from_engine, from_validation, is_engine_error
from ember.server.group import RequestGroup
from ember.server.http_io import EventStream, unless_left
from ember.server.limits import ApiKeyMiddleware, BodyLimitMiddleware
from ember.server.metrics import EngineSource, ServerMetrics
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ember.server.reasoning import resolve as resolve_reasoning
from ember.server.response_store import ResponseStore
from ember.server.streams import chat_stream, collect, completion_choice, completion_stream
from ember.server.supervisor import EngineSupervisor
from ember.server.tools import resolve_parser as resolve_tool_parser
from ember.server.translate import chat_prompt, completion_request, off_loop, prepared_chat_request

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One engine and the names it answers to as ``model`` (the first is the name in responses); ``loras``: its
    adapters, each answering to its ``lora_name`` as ``model`` (vLLM's ``--lora-modules``); ``restart``: how to
    start the same engine again when its loop stops (None: it is not restarted)."""

    names: tuple[str, ...]
    client: EngineClient
    loras: tuple[LoRARequest, ...] = ()
    restart: Callable[[], EngineClient] | None = None


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_key: str | None = None
    max_queue: int = 256  # engine requests waiting beyond an engine's running seats before 503
    max_request_bytes: int = 4 << 20
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id and retrieval (LRU) ...
    max_stored_response_bytes: int = 64 << 20  # ... and their JSON in bytes at most
    allowed_origins: tuple[str, ...] = ()  # CORS off when empty
    tool_call_parser: str = "auto"  # "auto": the format the model's chat template teaches; "none": tools refused
    reasoning_parser: str = "auto"  # "auto": <think> text split out where the template knows it; "none": never
    max_engine_restarts: int = 3  # a stopped engine is started again at most this often in ten minutes (0: never)


class _Engine:
    """A served engine with its own admission bound."""

    __slots__ = ("names", "client", "admission", "tool_parser", "thinks", "restarting")

    def __init__(self, model: ServedModel, settings: ServerSettings) -> None:
        self.names, self.client = model.names, model.client  # client: replaced when the engine is restarted
        self.restarting = False
        self.admission = Admission(model.client.model_info.max_num_seqs + settings.max_queue)
        template = model.client.tokenizer.chat_template
        self.tool_parser = resolve_tool_parser(settings.tool_call_parser, template)
        self.thinks = resolve_reasoning(settings.reasoning_parser, template)

    @property
    def name(self) -> str:
        return self.names[0]


class ServerState:
    """What the routes share: the engines, their admission, the metrics, and the requests in flight (for
    shutdown)."""

    def __init__(self, models: Sequence[ServedModel], settings: ServerSettings) -> None:
        if not models or any(not m.names for m in models):
            raise ValueError("serve at least one model, each with at least one name")
        self.settings = settings
        self.engines = [_Engine(m, settings) for m in models]
        self.by_name: dict[str, _Engine] = {}
        self.adapters: dict[str, LoRARequest] = {}  # adapter name -> its request (its engine is in by_name)
        for e, m in zip(self.engines, models):
            for name in (*e.names, *(lora.lora_name for lora in m.loras)):
                if name in self.by_name:
                    raise ValueError(f"served model name {name!r} is given twice: every name must be unique")
                self.by_name[name] = e
            self.adapters.update((lora.lora_name, lora) for lora in m.loras)
        self.metrics = ServerMetrics([EngineSource(e.name, _stats(e), _admitted(e.admission))
                                      for e in self.engines])
        self.supervisors = [EngineSupervisor(e, m.restart, m.loras, self.metrics, settings.max_engine_restarts)
                            for e, m in zip(self.engines, models) if m.restart is not None
                            and settings.max_engine_restarts > 0]
        self.in_flight: dict[str, RequestGroup] = {}
        self.responses = ResponseStore(settings.max_stored_responses, settings.max_stored_response_bytes)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def engine(self, model: str | None) -> _Engine:
        """The engine serving ``model``; the first one when the request names none."""
        if model is None:
            model = self.engines[0].name
        if model not in self.by_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(self.names)}",
                           param="model", code="model_not_found")
        engine = self.by_name[model]
        if engine.restarting:
            raise _restarting(engine)
        return engine

    def route(self, model: str | None) -> tuple[_Engine, LoRARequest | None, str]:
        """The engine serving ``model``, the adapter it names (None: the base model) and the name to answer with."""
        engine = self.engine(model)
        lora = self.adapters.get(model) if model is not None else None
        return engine, lora, model if lora is not None else engine.name

    def group(self, engine: _Engine, prefix: str) -> RequestGroup:
        return RequestGroup(engine.name, engine.client, engine.admission, self.metrics, self.in_flight,
                            f"{prefix}-{uuid.uuid4().hex}")

    def abort_all(self) -> None:
        """Shutdown: refuse new requests and abort every one in flight (their streams end with "abort")."""
        for e in self.engines:
            e.admission.closed = True
        for group in list(self.in_flight.values()):
            group.abort()


def _admitted(admission: Admission) -> Callable[[], tuple[int, int]]:
    return lambda: (admission.in_flight, admission.capacity)


def _stats(engine: _Engine) -> Callable[[], dict]:
    return lambda: engine.client.stats()  # the engine's client of the moment (a restart replaces it)


def _restarting(engine: _Engine) -> APIError:
    return APIError(503, f"the engine of {engine.name} stopped and is restarting; retry shortly",
                    code="engine_restarting", headers={"Retry-After": "5"})


@contextlib.asynccontextmanager
async def _supervised(app: FastAPI) -> AsyncIterator[None]:
    """The server's life: its engines' supervisors watch them until it shuts down."""
    state: ServerState = app.state.ember
    tasks = [asyncio.create_task(s.watch()) for s in state.supervisors]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in state.supervisors:
            await asyncio.to_thread(s.close)


def build_app(models: Sequence[ServedModel], settings: ServerSettings) -> FastAPI:
    state = ServerState(models, settings)
    app = FastAPI(title="ember", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_supervised)
    app.state.ember = state
    _install_errors(app, state)
    _install_routes(app, state)
    embeddings.install(app, state)
    responses_api.install(app, state)
    # outermost last: CORS answers preflights before the key check; the key is checked before the body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _install_errors(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(from_validation(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        if is_engine_error(e):
            return _error_response(from_engine(e, "prompt"))
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))


def _install_routes(app: FastAPI, state: ServerState) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health() -> Response:
        restarting = [e for e in state.engines if e.restarting]
        if restarting:
            raise _restarting(restarting[0])
        dead = [e.name for e in state.engines if not e.client.is_alive()]
        if dead:
            raise APIError(503, f"the engine of {', '.join(dead)} has stopped", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        # the engines' figures are read between their steps: wait for them off the event loop
        return Response(await asyncio.to_thread(state.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        data = []
        for name, e in state.by_name.items():
            card = {"id": name, "object": "model", "created": created, "owned_by": "ember",
                    "max_model_len": e.client.model_info.max_model_len}
            lora = state.adapters.get(name)
            if lora is not None:  # vLLM's adapter card: its folder and the model it adapts
                card.update(root=lora.lora_path, parent=e.name)
            data.append(card)
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        client = state.engine(req.model).client
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of prompt and messages", param="prompt")
        with engine_errors("messages" if req.messages is not None else "prompt"):
            if req.messages is not None:
                ids = await off_loop(any(m.has_images() for m in req.messages), lambda: client.prompt_token_ids(
                    chat_prompt(client, req.messages, req.add_generation_prompt)))
            else:
                ids = client.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": client.model_info.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        client = state.engine(req.model).client
        vocab = client.model_info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds {bad[0]}, out of range: token ids must be in [0, {vocab})",
                           param="tokens")
        return {"prompt": client.tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        engine, lora, model = state.route(req.model)
        client = engine.client
        _check_stream_options(req)
        group = state.group(engine, "chatcmpl")
        with engine_errors("messages"):
            prompt, params, reply = await prepared_chat_request(client, req, engine.tool_parser, engine.thinks)
            group.submit([prompt], params, lora)
        top = params.logprobs
        created = int(time.time())
        if req.stream:
            return EventStream(chat_stream(group, created, model, params.n, top, _usage(req),
                                            req.prediction is not None, reply), group.close)
        final = await unless_left(request, group, collect(group))
        if final is None:
            return Response(status_code=499)  # the client closed the connection: nobody reads an answer
        out = final[0]
        body = {"id": group.request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [R.chat_choice(o, top, reply) for o in out.outputs], "system_fingerprint": None,
                "usage": R.usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                                 R.prediction_counts(out, req.prediction is not None))}
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        engine, lora, model = state.route(req.model)
        client = engine.client
        _check_stream_options(req)
        group = state.group(engine, "cmpl")
        with engine_errors("prompt"):
            prompts, params = completion_request(client, req)
            group.submit(prompts, params, lora)
        created = int(time.time())
        if req.stream:
            return EventStream(completion_stream(group, created, model, params.n, req.logprobs, req.echo,
                                                  _usage(req), client), group.close)
        finals = await unless_left(request, group, collect(group))
        if finals is None:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choices.append(completion_choice(i * params.n + o.index, out, o, req.logprobs, req.echo, client))
        body = {"id": group.request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "system_fingerprint": None, "usage": R.usage(prompt_tokens, completion_tokens)}
        return JSONResponse(body)


def _check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


def _usage(req) -> bool:
    """A streamed request asked for the usage chunk at the end."""
    return bool(req.stream_options and req.stream_options.include_usage)
