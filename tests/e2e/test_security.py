"""docs/security.md's claims, one test each (named after the claim): a real ``ember serve`` of the default model
with an API key and one allowed CORS origin, spoken to over raw HTTP (http.client and sockets send paths as given:
no client-side normalisation of ``..``), plus the file-access claims that need no server (images, checkpoints'
remote code). The guards that need no model are tested in tests/unit/server/test_limits.py."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import urllib.parse

import pytest
from PIL import Image
from server_utils import TEST_ENGINE_ARGS, running_server

from ember.errors import BadRequestError
from ember.frontend.media import MediaPolicy, load_image
from ember.server import bounds as B

KEY = "sk-sec-5b1e0d7c"
ORIGIN = "http://good.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with running_server(*TEST_ENGINE_ARGS, "--api-key", KEY, "--allowed-origins", ORIGIN) as srv:
        yield srv
        assert request(srv, "GET", "/health")[0] == 200  # still serving after every hostile request


def request(srv, method: str, path: str, body: dict | bytes | None = None, headers: dict | None = None):
    """(status, body bytes, headers); the path is sent exactly as written."""
    host, port = urllib.parse.urlparse(srv.url).netloc.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = (r.status, r.read(), dict(r.getheaders()))
    conn.close()
    return out


def raw_head(srv, head: bytes) -> bytes:
    """Send request headers only (no body) over a socket and return the first response bytes."""
    host, port = urllib.parse.urlparse(srv.url).netloc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):  # the headers, then the JSON body
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def error(body: bytes) -> dict:
    return json.loads(body)["error"]


TRAVERSALS = ["/static/../../../../etc/passwd", "/static/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
              "/static/..%2f..%2f..%2f..%2fetc%2fpasswd", "/static//etc/passwd", "/static/%2fetc%2fpasswd",
              "/static/....//....//etc/passwd", "/static/..\\..\\..\\etc\\passwd", "/static/../app.py",
              "/static/%2e%2e/app.py", "/../../../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd"]


def test_no_path_traversal_through_the_static_route(server):
    for path in TRAVERSALS:  # with the key, so that every path reaches the routing
        status, body, _ = request(server, "GET", path, headers=AUTH)
        assert status == 404, path
        assert b"root:" not in body and b"import" not in body, path
    assert request(server, "GET", "/static/chat.js")[0] == 200  # the page's own files are served


def test_no_path_traversal_through_response_ids(server):
    for rid in ("../../etc/passwd", "..%2f..%2fetc%2fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/etc/passwd"):
        for method, suffix in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
            status, body, _ = request(server, method, f"/v1/responses/{rid}{suffix}", headers=AUTH)
            assert status == 404 and b"root:" not in body, (method, rid)


def test_model_names_are_looked_up_not_opened(server):
    for name in ("../../../etc/passwd", "/etc/passwd", "file:///etc/passwd"):
        status, body, _ = request(server, "POST", "/v1/completions", {"model": name, "prompt": "hi"}, AUTH)
        assert status == 404 and error(body)["code"] == "model_not_found" and b"root:" not in body


def test_no_route_loads_an_adapter_from_a_client_given_path(server):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, _, _ = request(server, "POST", path, {"lora_name": "x", "lora_path": "/etc"}, AUTH)
        assert status == 404


def test_a_wrong_key_is_refused_before_the_body_is_read(server):
    """Headers announcing a 1 GB body, and no body: the 401 comes back without the server waiting for it."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer wrong\r\nContent-Length: 1000000000\r\n\r\n")
    reply = raw_head(server, head)
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply


def test_a_body_larger_than_the_limit_is_refused_before_it_is_read(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000000000\r\n\r\n")
    reply = raw_head(server, head)
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply


def test_every_api_route_needs_the_key_and_the_open_ones_are_probes_and_the_page(server):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                         ("GET", "/v1/responses/resp_x")):
        assert request(server, method, path, {})[0] == 401, path
    for path in ("/", "/health", "/metrics", "/static/chat.js"):
        assert request(server, "GET", path)[0] == 200, path


def test_the_key_is_never_logged_or_echoed(server):
    wrong = f"Bearer {KEY[:-1]}x"
    for headers in (AUTH, {"Authorization": wrong}):
        status, body, _ = request(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers)
        assert KEY.encode() not in body and KEY[:-1].encode() not in body
    assert KEY not in server.log() and KEY[:-1] not in server.log()


def test_cors_answers_only_the_allowed_origin_without_credentials(server):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    _, _, good = request(server, "OPTIONS", "/v1/chat/completions", headers={"Origin": ORIGIN, **ask})
    _, _, evil = request(server, "OPTIONS", "/v1/chat/completions", headers={"Origin": "http://evil.example", **ask})
    good, evil = ({k.lower(): v for k, v in h.items()} for h in (good, evil))
    assert good["access-control-allow-origin"] == ORIGIN and "access-control-allow-origin" not in evil
    assert "access-control-allow-credentials" not in good and "access-control-allow-credentials" not in evil


def test_a_body_nested_deeper_than_the_parser_allows_is_a_400_and_serving_goes_on(server):
    status, body, _ = request(server, "POST", "/v1/completions", b"[" * 200_000 + b"]" * 200_000, AUTH)
    assert status == 400
    status, body, _ = request(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, AUTH)
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_at_the_depth_limit_compiles_and_one_past_it_is_refused_by_name(server):
    """The grammar compiler is reached only by schemas within MAX_JSON_DEPTH, which it compiles."""
    fmt = lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}  # noqa: E731
    messages = [{"role": "user", "content": "JSON please"}]
    levels = (B.MAX_JSON_DEPTH - 1) // 2
    status, body, _ = request(server, "POST", "/v1/chat/completions", {
        "messages": messages, "response_format": fmt(nested(levels)), "max_tokens": 8}, AUTH)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"].startswith('{"a"')  # the schema steers the reply
    status, body, _ = request(server, "POST", "/v1/chat/completions", {
        "messages": messages, "response_format": fmt(nested(levels + 1)), "max_tokens": 8}, AUTH)
    assert status == 400 and error(body)["param"] == "response_format.json_schema.schema"
    assert f"limit of {B.MAX_JSON_DEPTH}" in error(body)["message"]


def test_counts_the_engine_bounds_are_refused_before_anything_is_queued(server):
    """n beyond the engine's seats, top_logprobs past 20, a prompt past max_model_len: 400s naming the field."""
    cases = [("/v1/completions", {"prompt": "hi", "n": 10**9}, "n"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                       "top_logprobs": 21}, "top_logprobs"),
             ("/v1/completions", {"prompt": [1] * 5000}, "prompt"),
             ("/v1/completions", {"prompt": "hi", "best_of": 4}, "best_of"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 5}},
              "logit_bias")]
    for path, body, field in cases:
        status, reply, _ = request(server, "POST", path, body, AUTH)
        assert status == 400 and error(reply)["param"] == field, (field, reply)


def test_list_limits_hold_on_the_served_routes(server):
    cases = [("/v1/completions", {"prompt": ["a"] * (B.MAX_PROMPTS + 1)}, "prompt", B.MAX_PROMPTS),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * (B.MAX_MESSAGES + 1)},
              "messages", B.MAX_MESSAGES),
             ("/v1/embeddings", {"input": ["a"] * (B.MAX_INPUTS + 1)}, "input", B.MAX_INPUTS),
             ("/v1/responses", {"input": "a", "metadata": {str(i): "v" for i in range(B.MAX_METADATA + 1)}},
              "metadata", B.MAX_METADATA)]
    for path, body, field, limit in cases:
        status, reply, _ = request(server, "POST", path, body, AUTH)
        assert status == 400 and error(reply)["param"] == field and f"limit of {limit}" in error(reply)["message"]


def test_error_messages_do_not_name_the_servers_files(server):
    from ember.config import default_model_path

    model_path = default_model_path()
    bad = [("/v1/completions", {"model": "nope", "prompt": "hi"}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}]}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
           ("/tokenize", {"prompt": "a", "messages": []})]
    for path, body in bad:
        status, reply, _ = request(server, "POST", path, body, AUTH)
        assert status in (400, 404) and model_path.encode() not in reply
        assert os.path.dirname(model_path).encode() not in reply and b"/etc/hostname\\n" not in reply
    status, reply, _ = request(server, "GET", "/v1/models", headers=AUTH)
    assert status == 200 and model_path.encode() not in reply


# ---------------------------------------------------------------------------------------------- files, no server


@pytest.fixture
def folders(tmp_path):
    """tmp/allowed/ok.png, tmp/outside/secret.png, and tmp/allowed/link.png -> the secret."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(allowed / "ok.png")
    Image.new("RGB", (4, 4), (9, 9, 9)).save(outside / "secret.png")
    os.symlink(outside / "secret.png", allowed / "link.png")
    return allowed, outside


def test_image_files_are_read_only_under_the_allowed_folder_and_refusals_do_not_name_it(folders):
    allowed, outside = folders
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image("ok.png", "image", policy).getpixel((0, 0)) == (1, 2, 3)
    assert load_image((allowed / "ok.png").as_uri(), "image", policy).getpixel((0, 0)) == (1, 2, 3)
    for source in ("../outside/secret.png", str(outside / "secret.png"), (outside / "secret.png").as_uri(),
                   "link.png", (allowed / "link.png").as_uri(), f"file://{allowed}/%2e%2e/outside/secret.png",
                   "/etc/passwd", "file:///etc/passwd", "..", "/"):
        with pytest.raises(BadRequestError, match="is outside allowed_local_media_path") as info:
            load_image(source, "image", policy)
        assert str(allowed) not in str(info.value).split(" is not supported: ", 1)[1]  # past the value as given
    with pytest.raises(BadRequestError, match="local files are not allowed"):
        load_image(str(allowed / "ok.png"), "image", MediaPolicy())  # no folder given: no file at all


def test_image_urls_are_fetched_only_from_the_listed_hosts():
    for url, policy in (("http://127.0.0.1:9/a.png", MediaPolicy()),
                        ("http://169.254.169.254/latest/meta-data", MediaPolicy(allowed_media_domains=("a.example",))),
                        ("http://a.example@127.0.0.1/x.png", MediaPolicy(allowed_media_domains=("a.example",)))):
        with pytest.raises(BadRequestError, match="not allowed|not in allowed_media_domains"):
            load_image(url, "image", policy)


def remote_code_checkpoint(tokenizer_dir: str, out, model_type: str) -> str:
    """A checkpoint folder whose config and tokenizer ask (auto_map) for code in evil.py, which leaves a file
    behind if it is ever imported."""
    shutil.copytree(tokenizer_dir, out)
    sentinel = out / "RAN"
    (out / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n"
                                 "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
                                 "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_custom'\n"
                                 "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (out / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "vocab_size": 49152, "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer",
                                                                                             None]}}))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(sentinel)


def test_a_checkpoints_remote_code_is_never_run(tokenizer_dir, tmp_path, monkeypatch):
    """auto_map in config.json and tokenizer_config.json: a known model_type loads transformers' own class, an
    unknown one is refused; evil.py is never imported (and nothing asks on a terminal)."""
    from ember.model_loader.hf import load_hf_config
    from ember.tokenizer import Tokenizer

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    known = remote_code_checkpoint(tokenizer_dir, tmp_path / "known", "llama")
    assert type(load_hf_config(str(tmp_path / "known"))).__name__ == "LlamaConfig"
    try:
        Tokenizer.load(str(tmp_path / "known"))
    except (ValueError, OSError, AttributeError):
        pass  # refused: fine; what matters is that evil.py did not run
    assert not os.path.exists(known)
    unknown = remote_code_checkpoint(tokenizer_dir, tmp_path / "unknown", "evil_custom")
    with pytest.raises(ValueError, match="custom code"):
        load_hf_config(str(tmp_path / "unknown"))
    assert not os.path.exists(unknown) and not (tmp_path / "modules").exists()
