"""The server's guards that need no model: request-body bounds (bounds.py), the API key and body-size middlewares
(limits.py) and CORS, on the real app built over a stand-in engine client that has no engine at all, so any request
that got past a guard to the engine would fail with a 500 (the tests see 400 / 401 / 413 instead).

Each test is named after the claim in docs/security.md it checks."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from ember.server import bounds as B
from ember.server import limits
from ember.server.app import ServedModel, ServerSettings, build_app
from ember.server.embeddings import EmbeddingRequest
from ember.server.errors import from_validation
from ember.server.limits import ApiKeyMiddleware, BodyLimitMiddleware
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ember.server.responses_protocol import ResponsesRequest

KEY = "sk-test-7f3a9c"
MSG = {"role": "user", "content": "hi"}


class NoEngine:
    """The EngineClient attributes building the app reads; nothing that runs a request."""

    model_info = SimpleNamespace(max_num_seqs=4, max_model_len=128, vocab_size=100, encoder_only=False)
    tokenizer = SimpleNamespace(chat_template="")

    def is_alive(self) -> bool:
        return True

    def stats(self) -> dict:
        return {}


def app_client(**settings) -> TestClient:
    app = build_app([ServedModel(("tiny",), NoEngine())], ServerSettings(**settings))
    return TestClient(app, raise_server_exceptions=False)


def nested(levels: int) -> dict:
    """A JSON schema of ``levels`` objects, each holding the next: nested 2 * levels + 1 deep."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def refusal(model, body: dict):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return from_validation(info.value.errors())


# (request model, body with one field over its limit, the field, its size, the limit)
OVER = [
    (ChatCompletionRequest, {"messages": [MSG] * (B.MAX_MESSAGES + 1)}, "messages", B.MAX_MESSAGES + 1,
     B.MAX_MESSAGES),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                           * (B.MAX_CONTENT_PARTS + 1)}]},
     "messages.0.content", B.MAX_CONTENT_PARTS + 1, B.MAX_CONTENT_PARTS),
    (ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}] * (B.MAX_TOOL_CALLS + 1)}]},
     "messages.0.tool_calls", B.MAX_TOOL_CALLS + 1, B.MAX_TOOL_CALLS),
    (ChatCompletionRequest, {"messages": [MSG], "tools": [{"type": "function", "function": {"name": "f"}}]
                             * (B.MAX_TOOLS + 1)}, "tools", B.MAX_TOOLS + 1, B.MAX_TOOLS),
    (ChatCompletionRequest, {"messages": [MSG], "stop": ["x"] * (B.MAX_STOP + 1)}, "stop", B.MAX_STOP + 1,
     B.MAX_STOP),
    (ChatCompletionRequest, {"messages": [MSG], "stop_token_ids": [1] * (B.MAX_TOKEN_IDS + 1)}, "stop_token_ids",
     B.MAX_TOKEN_IDS + 1, B.MAX_TOKEN_IDS),
    (ChatCompletionRequest, {"messages": [MSG], "guided_choice": ["a"] * (B.MAX_CHOICES + 1)}, "guided_choice",
     B.MAX_CHOICES + 1, B.MAX_CHOICES),
    (ChatCompletionRequest, {"messages": [MSG], "chat_template_kwargs": {f"k{i}": 1 for i in range(B.MAX_KEYS + 1)}},
     "chat_template_kwargs", B.MAX_KEYS + 1, B.MAX_KEYS),
    (ChatCompletionRequest, {"messages": [MSG], "structured_outputs": {f"k{i}": 1 for i in range(B.MAX_KEYS + 1)}},
     "structured_outputs", B.MAX_KEYS + 1, B.MAX_KEYS),
    (ChatCompletionRequest, {"messages": [MSG], "prediction": {"type": "content", "content": [
        {"type": "text", "text": "a"}] * (B.MAX_CONTENT_PARTS + 1)}}, "prediction.content",
     B.MAX_CONTENT_PARTS + 1, B.MAX_CONTENT_PARTS),
    (CompletionRequest, {"prompt": ["a"] * (B.MAX_PROMPTS + 1)}, "prompt", B.MAX_PROMPTS + 1, B.MAX_PROMPTS),
    (CompletionRequest, {"prompt": [[1]] * (B.MAX_PROMPTS + 1)}, "prompt", B.MAX_PROMPTS + 1, B.MAX_PROMPTS),
    (CompletionRequest, {"prompt": [1] * (B.MAX_TOKEN_IDS + 1)}, "prompt", B.MAX_TOKEN_IDS + 1, B.MAX_TOKEN_IDS),
    (EmbeddingRequest, {"input": ["a"] * (B.MAX_INPUTS + 1)}, "input", B.MAX_INPUTS + 1, B.MAX_INPUTS),
    (EmbeddingRequest, {"input": [[1] * (B.MAX_TOKEN_IDS + 1)]}, "input", B.MAX_TOKEN_IDS + 1, B.MAX_TOKEN_IDS),
    (TokenizeRequest, {"messages": [MSG] * (B.MAX_MESSAGES + 1)}, "messages", B.MAX_MESSAGES + 1, B.MAX_MESSAGES),
    (DetokenizeRequest, {"tokens": [1] * (B.MAX_TOKEN_IDS + 1)}, "tokens", B.MAX_TOKEN_IDS + 1, B.MAX_TOKEN_IDS),
    (ResponsesRequest, {"input": [MSG] * (B.MAX_MESSAGES + 1)}, "input", B.MAX_MESSAGES + 1, B.MAX_MESSAGES),
    (ResponsesRequest, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]
                                   * (B.MAX_CONTENT_PARTS + 1)}]}, "input.0.message.content", B.MAX_CONTENT_PARTS + 1,
     B.MAX_CONTENT_PARTS),
    (ResponsesRequest, {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "a",
                                                                     "annotations": [{}] * (B.MAX_ANNOTATIONS + 1)}]}]},
     "input.0.message.content.0.output_text.annotations", B.MAX_ANNOTATIONS + 1, B.MAX_ANNOTATIONS),
    (ResponsesRequest, {"input": "x", "tools": [{"type": "function", "name": "f"}] * (B.MAX_TOOLS + 1)}, "tools",
     B.MAX_TOOLS + 1, B.MAX_TOOLS),
    (ResponsesRequest, {"input": "x", "metadata": {f"k{i}": "v" for i in range(B.MAX_METADATA + 1)}}, "metadata",
     B.MAX_METADATA + 1, B.MAX_METADATA),
    (ResponsesRequest, {"input": "x", "include": ["a"] * (B.MAX_INCLUDE + 1)}, "include", B.MAX_INCLUDE + 1,
     B.MAX_INCLUDE),
    (ResponsesRequest, {"input": "x", "stream_options": {f"k{i}": 1 for i in range(B.MAX_KEYS + 1)}},
     "stream_options", B.MAX_KEYS + 1, B.MAX_KEYS),
]


@pytest.mark.parametrize("model, body, field, count, limit", OVER, ids=[f"{m.__name__}.{f}" for m, _, f, _, _ in OVER])
def test_every_list_a_request_carries_has_a_count_limit(model, body, field, count, limit):
    e = refusal(model, body)
    assert e.status == 400 and e.param == field
    assert re.search(rf": holds (a list of )?{count} \w+( \w+)?, more than the limit of {limit}$", e.message)
    assert e.message.startswith(field + "=")


@pytest.mark.parametrize("model, body, field, count, limit", OVER, ids=[f"{m.__name__}.{f}" for m, _, f, _, _ in OVER])
def test_a_list_at_its_limit_is_accepted(model, body, field, count, limit):
    """The same bodies with one item fewer pass validation: the limit is the count allowed, not one less."""
    def trim(value, path):
        key, rest = path[0], path[1:]
        if isinstance(value, dict) and key not in value:  # a union member's tag in the error's path
            return trim(value, rest)
        key = int(key) if isinstance(value, list) else key
        if not rest:
            v = value[key]
            if isinstance(v, dict):
                value[key] = dict(list(v.items())[:-1])
            elif isinstance(v[0], list) and field in ("input", "prompt") and len(v) == 1:
                v[0] = v[0][:-1]
            else:
                value[key] = v[:-1]
        else:
            trim(value[key], rest)

    body = json.loads(json.dumps(body))
    trim(body, field.split("."))
    model.model_validate(body)


def test_metadata_keys_and_values_have_openais_length_limits():
    long_value = refusal(ResponsesRequest, {"input": "x", "metadata": {"k": "v" * (B.MAX_METADATA_VALUE + 1)}})
    long_key = refusal(ResponsesRequest, {"input": "x", "metadata": {"k" * (B.MAX_METADATA_KEY + 1): "v"}})
    assert long_value.param == "metadata.k" and f"at most {B.MAX_METADATA_VALUE} characters" in long_value.message
    assert long_key.param.startswith("metadata.") and f"at most {B.MAX_METADATA_KEY} characters" in long_key.message
    ResponsesRequest.model_validate({"input": "x", "metadata": {"k" * B.MAX_METADATA_KEY: "v" * B.MAX_METADATA_VALUE}})


# every free-form JSON field (schemas, template variables), with a value nested past MAX_JSON_DEPTH
DEEP = nested(B.MAX_JSON_DEPTH)  # 2 * 64 + 1 deep
NESTED = [
    (ChatCompletionRequest, {"messages": [MSG], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}}, "response_format.json_schema.schema"),
    (ChatCompletionRequest, {"messages": [MSG], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": DEEP}}]}, "tools.0.function.parameters"),
    (ChatCompletionRequest, {"messages": [MSG], "guided_json": DEEP}, "guided_json"),
    (ChatCompletionRequest, {"messages": [MSG], "structured_outputs": {"json": DEEP}}, "structured_outputs"),
    (ChatCompletionRequest, {"messages": [MSG], "chat_template_kwargs": {"x": DEEP}}, "chat_template_kwargs"),
    (ResponsesRequest, {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}},
     "text.format.schema"),
    (ResponsesRequest, {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": DEEP}]},
     "tools.0.parameters"),
    (ResponsesRequest, {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "a",
                                                                     "annotations": [DEEP]}]}]},
     "input.0.message.content.0.output_text.annotations"),
]


@pytest.mark.parametrize("model, body, field", NESTED, ids=[f for _, _, f in NESTED])
def test_free_form_json_is_nested_at_most_64_deep(model, body, field):
    e = refusal(model, body)
    assert e.status == 400 and e.param == field and f"limit of {B.MAX_JSON_DEPTH}" in e.message
    assert "levels deep" in e.message


def test_a_schema_given_as_json_text_is_measured_as_what_it_holds():
    text = json.dumps(DEEP)
    for body, field in (({"guided_json": text}, "guided_json"), ({"structured_outputs": {"json": text}},
                                                                  "structured_outputs")):
        e = refusal(ChatCompletionRequest, {"messages": [MSG], **body})
        assert e.param == field and f"nested {B.depth(DEEP)} levels deep" in e.message
    beyond_the_parser = "[" * 100_000 + "]" * 100_000
    e = refusal(ChatCompletionRequest, {"messages": [MSG], "guided_json": beyond_the_parser})
    assert e.param == "guided_json" and "too deep to parse" in e.message
    ChatCompletionRequest.model_validate({"messages": [MSG], "guided_json": "not JSON"})  # refused later, by name


def test_a_schema_nested_to_the_limit_is_accepted():
    levels = (B.MAX_JSON_DEPTH - 1) // 2  # 2 * 31 + 1 = 63 deep
    req = ChatCompletionRequest.model_validate({"messages": [MSG], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": nested(levels)}}})
    assert B.depth(req.response_format.json_schema.schema_) == 2 * levels + 1


def test_depth_is_measured_without_recursion():
    """A value far deeper than Python's recursion limit is measured, not crashed on."""
    value: list = []
    for _ in range(100_000):
        value = [value]
    assert B.depth(value) == 100_001
    assert B.depth({"a": [1, {"b": {}}], "c": 2}) == 4 and B.depth("text") == 0 and B.depth({}) == 1


# ---------------------------------------------------------------------------------------------- middlewares


def run_asgi(app, path: str, headers: dict[str, str], body_chunks=(b"",), method: str = "POST"):
    """One request through an ASGI app; returns (status, body, how many times the body was read). body_chunks
    None: a body that never ends."""
    reads, sent = [], []
    chunks = list(body_chunks) if body_chunks is not None else []

    async def receive():
        reads.append(1)
        if chunks or body_chunks is not None:
            return {"type": "http.request", "body": chunks.pop(0) if chunks else b"", "more_body": bool(chunks)}
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}  # an endless body

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, len(reads)


async def reached(scope, receive, send):
    """The app behind the guards: answers 200 once it has read the whole body."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached"})


def guarded(max_bytes: int = 1024):
    """The guards as build_app stacks them: the key outside the body limit."""
    return ApiKeyMiddleware(BodyLimitMiddleware(reached, max_bytes=max_bytes), api_key=KEY)


def test_a_wrong_or_missing_key_is_refused_before_the_body_is_read():
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}):
        status, body, reads = run_asgi(guarded(), "/v1/chat/completions", {"Content-Length": "1000000", **headers},
                                       None)
        assert (status, reads) == (401, 0)
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body, _ = run_asgi(guarded(), "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}, [b"{}"])
    assert (status, body) == (200, b"reached")


def test_the_key_is_compared_in_constant_time(monkeypatch):
    """Every guarded request's key goes through hmac.compare_digest (never ==, which stops at the first byte that
    differs)."""
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(limits.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    for given in ("Bearer nope", f"Bearer {KEY}"):
        run_asgi(guarded(), "/v1/models", {"Authorization": given}, method="GET")
    assert calls == [(b"Bearer nope", f"Bearer {KEY}".encode()), (f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode())]


def test_the_401_answer_never_echoes_a_key():
    status, body, _ = run_asgi(guarded(), "/v1/models", {"Authorization": "Bearer guess-123"}, method="GET")
    assert status == 401 and b"guess-123" not in body and KEY.encode() not in body


def test_a_body_declared_larger_than_the_limit_is_refused_before_it_is_read():
    status, body, reads = run_asgi(guarded(), "/v1/completions", {"Authorization": f"Bearer {KEY}",
                                                                   "Content-Length": str(1 << 30)}, None)
    assert (status, reads) == (413, 0) and json.loads(body)["error"]["code"] == "request_too_large"


def test_an_endless_body_is_read_only_up_to_the_limit():
    """No Content-Length (chunked) and no end: reading stops at the first chunk past the limit."""
    status, _, reads = run_asgi(guarded(max_bytes=200_000), "/v1/completions", {"Authorization": f"Bearer {KEY}"},
                                None)
    assert status == 413 and reads == 200_000 // 65536 + 1


# ---------------------------------------------------------------------------------------------- the whole app

GUARDED = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
           ("POST", "/v1/embeddings"), ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
           ("DELETE", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
           ("GET", "/v1/responses/resp_1/input_items"), ("POST", "/tokenize"), ("POST", "/detokenize")]
OPEN = [("GET", "/"), ("GET", "/static/chat.js"), ("GET", "/health"), ("GET", "/metrics")]


def test_every_api_route_needs_the_key_and_only_the_page_health_and_metrics_are_open():
    client = app_client(api_key=KEY)
    for method, path in GUARDED:
        assert client.request(method, path, json={}).status_code == 401, path
        assert client.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}"}).status_code != 401
    for method, path in OPEN:  # (the stand-in has no figures for /metrics: reached, it fails, but not with 401)
        assert client.request(method, path).status_code != 401, path
    assert set(limits.OPEN_PATHS) == {"/", "/health", "/metrics", "/favicon.ico"}
    assert limits.OPEN_PREFIXES == ("/static/",)


def test_no_route_loads_an_adapter_or_a_model_from_a_client_given_path():
    routes = {getattr(r, "path", "") for r in build_app([ServedModel(("tiny",), NoEngine())],
                                                         ServerSettings()).routes}
    assert not [p for p in routes if "lora" in p or "load" in p or "adapter" in p]
    client = app_client()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert client.post(path, json={"lora_name": "x", "lora_path": "/etc"}).status_code == 404


def test_cors_is_off_by_default():
    client = app_client()
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    plain = client.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in plain.headers


def test_cors_allows_only_the_listed_origins_and_never_credentials():
    client = app_client(allowed_origins=("http://good.example",), api_key=KEY)
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    good = client.options("/v1/chat/completions", headers={"Origin": "http://good.example", **ask})
    evil = client.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **ask})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "http://good.example"
    assert "access-control-allow-origin" not in evil.headers
    simple = client.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in simple.headers
    for r in (good, evil, simple):
        assert "access-control-allow-credentials" not in r.headers


def test_an_oversized_list_is_refused_before_the_engine_is_reached():
    """The stand-in client has no engine: a request past the checks would be a 500."""
    client = app_client()
    r = client.post("/v1/chat/completions", json={"messages": [MSG], "stop": ["x"] * (B.MAX_STOP + 1)})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "stop" and f"limit of {B.MAX_STOP}" in error["message"]


def test_a_body_nested_past_the_json_parser_is_a_400():
    client = app_client()
    r = client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_docs_security_cites_each_test_and_each_test_is_cited():
    """docs/security.md names its tests: each named one exists, and each test of the two modules is named."""
    import os
    import re as _re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    doc = open(os.path.join(root, "docs", "security.md")).read()
    cited = set(_re.findall(r"`(?:[\w/.]+::)?(test_\w+)`", doc))
    defined = set()
    for module in ("tests/unit/server/test_limits.py", "tests/e2e/test_security.py"):
        defined |= set(_re.findall(r"^def (test_\w+)", open(os.path.join(root, module)).read(), _re.M))
    page = set(_re.findall(r"^def (test_\w+)", open(os.path.join(root, "tests/e2e/test_server_page.py")).read(),
                           _re.M))
    assert cited - defined - page == set()
    assert defined - cited == set()
