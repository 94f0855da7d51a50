"""The soak's requests (``ember bench soak``): every kind a long-running server meets, each with what its answer must
be, so that a 500, a hang or a request with no final status is caught on the request it happened to.

A kind builds one HTTP request (``Shot``) from a seeded random stream; ``fire`` sends it on its own connection with
``ember.benchmarks.http.post`` (raw HTTP, so the client can leave at an exact point) and ``judge`` turns the answer
into an ``Outcome``: its status, whether it was judged right, and what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from ember.benchmarks.http import post

WORDS = ("river", "stone", "lamp", "seven", "blue", "garden", "engine", "quiet", "paper", "north", "salt", "cloud")
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "score": {
    "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "score"], "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Shot:
    """One request to send and how the client behaves."""

    kind: str
    path: str
    body: dict | bytes
    expect: tuple[int, ...] = (200,)  # statuses that are right (503: refused at capacity, always allowed)
    stream: bool = False
    leave_after_events: int | None = None  # a client that closes its stream after this many events
    leave_after_s: float | None = None  # a client that closes its connection before a non-streamed answer
    model: str = "base"
    timed: bool = True  # counted in the latency windows (whole answers of the steady load)


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    model: str
    status: int  # 0: no status line (the client left first, or a hang)
    ok: bool
    end: float  # monotonic seconds
    latency: float
    timed: bool
    left: bool = False  # the client left on purpose
    problem: str = ""


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _chat(rng: random.Random, model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": _prompt(rng, rng.randint(3, 40))}],
            "max_tokens": rng.randint(4, 48), "temperature": 0.8, **kw}


def _completion(rng: random.Random, model: str, **kw) -> dict:
    return {"model": model, "prompt": _prompt(rng, rng.randint(3, 60)), "max_tokens": rng.randint(4, 48),
            "temperature": 0.8, **kw}


def bad_requests(max_model_len: int) -> list[tuple[str, dict | bytes, tuple[int, ...]]]:
    """Hostile bodies and the status each must get: wrong types, NaN, unknown fields, out-of-range values, broken
    JSON, unknown models, prompts past the context."""
    msg = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/chat/completions", {"messages": "hi"}, (400,)),
        ("/v1/chat/completions", {"messages": msg, "max_tokens": "10"}, (400,)),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', (400,)),
        ("/v1/chat/completions", {"messages": msg, "temperature": None, "frobnicate": 1}, (400,)),
        ("/v1/chat/completions", {"messages": msg, "n": 0}, (400,)),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, (400,)),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, (400,)),
        ("/v1/completions", {"prompt": "hi", "top_p": 7.5}, (400,)),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', (400,)),
        ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, (404,)),
        ("/v1/completions", {"prompt": [7] * (max_model_len + 8), "max_tokens": 4}, (400,)),
        ("/v1/completions", {"prompt": "hi", "n": 2, "use_beam_search": True, "top_p": 0.5}, (400,)),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, (400,)),
        ("/v1/chat/completions", {"messages": msg, "stream_options": {"include_usage": True}}, (400,)),
    ]


class Kinds:
    """The steady load's mix: ``next(rng)`` draws one request. Models alternate between the base and the adapters,
    so that with ``--max-loras 1`` the engine swaps adapters all the time."""

    WEIGHTS = {"chat": 3, "chat_stream": 3, "completion": 3, "completion_stream": 3, "n_samples": 2, "beams": 1,
               "json_schema": 2, "abort_stream": 1, "disconnect": 1, "bad_request": 2}

    def __init__(self, models: tuple[str, ...], adapters: tuple[str, ...], max_model_len: int) -> None:
        self.models, self.adapters = models, adapters
        self.bad = bad_requests(max_model_len)
        self.names = list(self.WEIGHTS)
        self.weights = list(self.WEIGHTS.values())
        self._bad_next = 0

    def next(self, rng: random.Random) -> Shot:
        kind = rng.choices(self.names, self.weights)[0]
        model = rng.choice(self.models)
        label = "base" if model not in self.adapters else model
        if kind == "chat":
            return Shot(kind, "/v1/chat/completions", _chat(rng, model), model=label)
        if kind == "chat_stream":
            body = _chat(rng, model, stream=True, stream_options={"include_usage": True})
            return Shot(kind, "/v1/chat/completions", body, stream=True, model=label)
        if kind == "completion":
            return Shot(kind, "/v1/completions", _completion(rng, model), model=label)
        if kind == "completion_stream":
            return Shot(kind, "/v1/completions", _completion(rng, model, stream=True), stream=True, model=label)
        if kind == "n_samples":
            stream = rng.random() < 0.5
            body = _completion(rng, model, n=rng.randint(2, 4), seed=rng.randint(0, 1 << 20), stream=stream)
            return Shot(kind, "/v1/completions", body, stream=stream, model=label)
        if kind == "beams":
            body = _completion(rng, model, n=rng.randint(2, 3), use_beam_search=True, temperature=0,
                               max_tokens=rng.randint(4, 16))
            return Shot(kind, "/v1/completions", body, model=label)
        if kind == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER_SCHEMA}}
            return Shot(kind, "/v1/chat/completions", _chat(rng, model, response_format=fmt, max_tokens=48),
                        model=label)
        if kind == "abort_stream":
            body = _chat(rng, model, stream=True, max_tokens=200, ignore_eos=True)
            return Shot(kind, "/v1/chat/completions", body, stream=True, model=label,
                        leave_after_events=rng.randint(1, 6), timed=False)
        if kind == "disconnect":
            body = _completion(rng, model, max_tokens=200, ignore_eos=True)
            return Shot(kind, "/v1/completions", body, model=label, leave_after_s=rng.uniform(0.05, 1.0),
                        timed=False)
        path, body, expect = self.bad[self._bad_next % len(self.bad)]
        self._bad_next += 1
        return Shot("bad_request", path, body, expect=expect, timed=False)

    @staticmethod
    def burst(rng: random.Random, model: str) -> Shot:
        """A burst's request: short, so the burst is over quickly; 503 expected for those past the queue."""
        return Shot("burst", "/v1/completions", _completion(rng, model, max_tokens=8), expect=(200, 503),
                    timed=False)


async def fire(url: str, shot: Shot, timeout: float) -> Outcome:
    start = time.monotonic()
    limit = shot.leave_after_s if shot.leave_after_s is not None else timeout
    try:
        answer = await post(url, shot.path, shot.body, leave_after_events=shot.leave_after_events, timeout=limit)
    except (TimeoutError, asyncio.TimeoutError):
        end = time.monotonic()
        if shot.leave_after_s is not None:  # left on purpose before the answer
            return Outcome(shot.kind, shot.model, 0, True, end, end - start, False, left=True)
        return Outcome(shot.kind, shot.model, 0, False, end, end - start, False, problem=f"no answer in {timeout} s")
    except OSError as e:
        end = time.monotonic()
        return Outcome(shot.kind, shot.model, 0, False, end, end - start, False, problem=f"connection: {e}")
    end = time.monotonic()
    ok, problem = judge(shot, answer.status, answer.body, answer.events)
    left = shot.leave_after_events is not None and answer.status == 200
    return Outcome(shot.kind, shot.model, answer.status, ok, end, end - start, shot.timed and answer.status == 200
                   and ok, left=left, problem=problem)


def judge(shot: Shot, status: int, body: bytes, events: list[str]) -> tuple[bool, str]:
    """Whether the answer is right for its request: the expected status, an OpenAI error object for errors, and for
    whole answers every choice with a final status (finish_reason) and, for JSON schema, JSON that follows it."""
    if status == 503:  # right only when the server is at capacity; an engine that died or restarted is not
        try:
            code = json.loads(body)["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        return (True, "") if code == "server_overloaded" else (False, f"503 {code}: {body[:200]!r}")
    if status not in shot.expect:
        return False, f"status {status} (expected {shot.expect}): {body[:200]!r}"
    if status != 200:
        try:
            error = json.loads(body)["error"]
            return bool(error.get("message")), ""
        except (ValueError, KeyError, TypeError):
            return False, f"status {status} without an OpenAI error object: {body[:200]!r}"
    if shot.leave_after_events is not None:
        return True, ""
    n = shot.body.get("n", 1) if isinstance(shot.body, dict) else 1
    try:
        choices = _streamed(events, n) if shot.stream else json.loads(body)["choices"]
    except (ValueError, KeyError, TypeError) as e:
        return False, f"unreadable answer ({e}): {body[-200:]!r}"
    if len(choices) != n or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return False, f"{len(choices)} choices for n={n}, finish reasons {[c.get('finish_reason') for c in choices]}"
    if shot.kind == "json_schema":
        for c in choices:
            if c["finish_reason"] == "stop" and not _follows_schema(c["message"]["content"]):
                return False, f"reply does not follow the schema: {c['message']['content']!r}"
    return True, ""


def _streamed(events: list[str], n: int) -> list[dict]:
    """The choices a stream finished, from its chunks; it must end with [DONE]."""
    if not events or events[-1] != "[DONE]":
        raise ValueError("the stream did not end with [DONE]")
    ends: dict[int, str | None] = {}
    for event in events[:-1]:
        for c in json.loads(event).get("choices", []):
            if c.get("finish_reason") is not None or c["index"] not in ends:
                ends[c["index"]] = c.get("finish_reason")
    return [{"finish_reason": ends[i]} for i in sorted(ends)]


def _follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = ANSWER_SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == {"answer", "score"} and value["answer"] in props["answer"]["enum"]
            and isinstance(value["score"], int) and 0 <= value["score"] <= 9)
