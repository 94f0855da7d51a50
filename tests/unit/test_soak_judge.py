"""The soak's judge (ember/benchmarks/soak_load.py) on made-up answers: the checks the long run rests on must fail
on the failures they are there for (a 500, a stream with no [DONE], a choice with no finish reason, JSON off the
schema), and pass the answers that are right (503 at capacity, an OpenAI error object for a bad body)."""

from __future__ import annotations

import json
import random

from ember.benchmarks.soak_load import Kinds, Shot, judge, bad_requests

COMPLETION = Shot("completion", "/v1/completions", {"prompt": "x", "n": 2})
STREAM = Shot("completion_stream", "/v1/completions", {"prompt": "x", "stream": True}, stream=True)
SCHEMA = Shot("json_schema", "/v1/chat/completions", {"messages": []})


def _body(*reasons: str | None) -> bytes:
    return json.dumps({"choices": [{"index": i, "text": "t", "finish_reason": r} for i, r in
                                   enumerate(reasons)]}).encode()


def _chunk(index: int, reason: str | None) -> str:
    return json.dumps({"choices": [{"index": index, "text": "t", "finish_reason": reason}]})


def test_statuses():
    assert judge(COMPLETION, 200, _body("stop", "length"), [])[0]
    assert judge(COMPLETION, 503, b'{"error": {"message": "busy", "code": "server_overloaded"}}', [])[0]
    for code in ("engine_dead", "engine_restarting", "request_failed"):  # 503s that are failures, not capacity
        assert not judge(COMPLETION, 503, b'{"error": {"message": "x", "code": "%s"}}' % code.encode(), [])[0]
    ok, problem = judge(COMPLETION, 500, b'{"error": {"message": "boom"}}', [])
    assert not ok and "status 500" in problem
    bad = Shot("bad_request", "/v1/completions", {"n": 0}, expect=(400,))
    assert judge(bad, 400, b'{"error": {"message": "n=0 is out of range"}}', [])[0]
    assert not judge(bad, 400, b"plain text", [])[0]
    assert not judge(bad, 200, _body("stop"), [])[0]


def test_final_status_of_every_choice():
    assert not judge(COMPLETION, 200, _body("stop"), [])[0]  # n=2, one choice
    assert not judge(COMPLETION, 200, _body("stop", None), [])[0]
    assert not judge(COMPLETION, 200, _body("stop", "abort"), [])[0]
    assert judge(STREAM, 200, b"", [_chunk(0, None), _chunk(0, "length"), "[DONE]"])[0]
    assert not judge(STREAM, 200, b"", [_chunk(0, None), _chunk(0, "length")])[0]  # no [DONE]
    assert not judge(STREAM, 200, b"", [_chunk(0, None), "[DONE]"])[0]
    assert not judge(STREAM, 200, b"", [json.dumps({"error": {"message": "engine died"}}), "[DONE]"])[0]


def test_json_schema_replies():
    def reply(text: str, reason: str = "stop") -> bytes:
        return json.dumps({"choices": [{"index": 0, "message": {"content": text}, "finish_reason": reason}]}).encode()

    assert judge(SCHEMA, 200, reply('{"answer": "yes", "score": 3}'), [])[0]
    assert not judge(SCHEMA, 200, reply('{"answer": "perhaps", "score": 3}'), [])[0]
    assert not judge(SCHEMA, 200, reply('{"answer": "yes"}'), [])[0]
    assert judge(SCHEMA, 200, reply('{"answer": "ye', "length"), [])[0]  # cut by max_tokens: not a whole reply


def test_kinds_draw_every_kind_and_cycle_bad_bodies():
    kinds = Kinds(("soak", "a", "b"), ("a", "b"), 512)
    rng = random.Random(0)
    shots = [kinds.next(rng) for _ in range(2000)]
    assert {s.kind for s in shots} == set(Kinds.WEIGHTS)
    assert {s.model for s in shots} == {"base", "a", "b"}
    bad = [s for s in shots if s.kind == "bad_request"]
    assert len({s.body if isinstance(s.body, bytes) else json.dumps(s.body) for s in bad}) == len(bad_requests(512))


def test_server_output_tracebacks_are_counted():
    """A traceback the server prints (a failure its clients may never see) is found by its exception line."""
    import sys

    from ember.benchmarks.soak import Server

    script = ("print('[ember] serving x: ready on http://127.0.0.1:1', flush=True)\n"
              "import traceback\n"
              "try:\n    raise KeyError('slot')\nexcept KeyError:\n    traceback.print_exc()\n"
              "print('after', flush=True)")
    server = Server([sys.executable, "-c", script], threads=1, timeout=60)
    assert server.url == "http://127.0.0.1:1"
    server.proc.wait(60)
    server.stop()
    assert server.tracebacks == ["KeyError: 'slot'"]
    assert "after" in server.log(5)
