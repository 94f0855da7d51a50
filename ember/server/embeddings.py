"""``POST /v1/embeddings``: OpenAI's embeddings endpoint (and vLLM's extras ``truncate_prompt_tokens``,
``normalize``) on the same engines as chat and completions, so one ``ember serve`` answers both; an encoder
(BERT) served alone answers embeddings only. Each input is one pooling request, admitted, aborted and timed as
the other routes' requests (``RequestGroup``)."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.outputs import EmbeddingRequestOutput
from ember.protocol import PoolingParams
from ember.server.errors import APIError, engine_errors
from ember.server.group import RequestGroup
from ember.server.bounds import MAX_INPUTS, prompts_at_most
from ember.server.http_io import unless_left
from ember.server.protocol import _Body


class EmbeddingRequest(_Body):
    input: Annotated[str | list[str] | list[int] | list[list[int]], prompts_at_most(MAX_INPUTS, "inputs")]
    model: str | None = None  # None: the served model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first ``dimensions`` values, normalised again
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM: keep k tokens of a longer input (-1: max_model_len)
    normalize: bool | None = None  # vLLM: L2-normalise (None: the model's default)


def inputs(value: str | list) -> list[str | list[int]]:
    """OpenAI's ``input`` as prompts: a string, a list of strings, a list of token ids (one input) or a list of
    those."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input=[] is empty: pass a string, a list of strings or token ids", param="input")
    if isinstance(value[0], int):
        return [value]
    return list(value)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the values; base64: their little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def body(finals: list[EmbeddingRequestOutput], model: str, encoding_format: str) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(o.outputs.embedding, encoding_format)}
                     for i, o in enumerate(finals)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _finals(group: RequestGroup) -> list[EmbeddingRequestOutput]:
    finals: list = [None] * len(group.ids)
    async for i, out in group.deltas():  # one output a request, once it is finished
        finals[i] = out
    return finals


def install(app: FastAPI, state: Any) -> None:
    """Add the route to the app over the server's state (``app.ServerState``)."""

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> Response:
        engine, lora, model = state.route(req.model)
        if lora is not None:
            raise APIError(400, f"model={req.model!r} is a LoRA adapter: embeddings run on the base model",
                           param="model")
        prompts = inputs(req.input)
        params = PoolingParams(None, req.normalize, req.dimensions, req.truncate_prompt_tokens)
        group = state.group(engine, "embd")
        with engine_errors("input"):
            group.submit(prompts, params)
        finals = await unless_left(request, group, _finals(group))
        if finals is None:
            return Response(status_code=499)  # the client closed the connection: nobody reads an answer
        ended = [o.finish_reason for o in finals if o.finish_reason != "stop"]
        if ended:
            raise APIError(503, f"an input's request ended with {ended[0]!r} before its embedding was computed",
                           code="embedding_" + ended[0])
        return JSONResponse(body(finals, model, req.encoding_format))
