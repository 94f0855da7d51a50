"""``ember serve`` through the real ``openai`` client and raw sockets, on 127.0.0.1, default model in float32.

Greedy tokens equal ``LLM.generate`` in the same settings; streams, n, logprobs, stop, echo and usage follow OpenAI's
shapes; errors are OpenAI error objects with the field named; a flood of streams ends in answers or 503s and leaves
no KV block held; clients that leave abort their requests; fuzzed bodies never get a 500; SIGTERM aborts the
requests in flight and the process ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import TEST_ENGINE_ARGS, metric_sum, post, rss_bytes, running_server


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server():
    with running_server(*TEST_ENGINE_ARGS, "--max-queue", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def llm():
    from ember import LLM

    engine = LLM(dtype="float32", max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=512)  # TEST_ENGINE_ARGS
    yield engine
    engine.shutdown()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _greedy(**kw):
    from ember import SamplingParams

    return SamplingParams(temperature=0.0, **kw)


def test_models_health_tokenize(server, api, model):
    listed = api.models.list().data
    assert [m.id for m in listed] == [model] and listed[0].owned_by == "ember"
    assert _get(server.url + "/health")[0] == 200
    tok = asyncio.run(post(server.url, "/tokenize", {"prompt": "Hello world"}))
    ids = json.loads(tok.body)["tokens"]
    assert tok.status == 200 and ids and json.loads(tok.body)["count"] == len(ids)
    back = asyncio.run(post(server.url, "/detokenize", {"tokens": ids}))
    assert json.loads(back.body)["prompt"] == "Hello world"
    chat = asyncio.run(post(server.url, "/tokenize", {"messages": QUESTION}))
    assert json.loads(chat.body)["count"] > len(ids)


def test_chat_greedy_matches_llm(api, model, llm):
    ref = llm.chat(QUESTION, _greedy(max_tokens=24, logprobs=0))[0].outputs[0]
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == ref.text
    assert choice.message.role == "assistant" and r.object == "chat.completion"
    # the tokens themselves, one logprob entry each
    assert [c.token for c in choice.logprobs.content] == [lp[t].decoded_token for t, lp in
                                                         zip(ref.token_ids, ref.logprobs)]
    for c, t, lp in zip(choice.logprobs.content, ref.token_ids, ref.logprobs):
        assert c.logprob == pytest.approx(lp[t].logprob, abs=1e-4)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert choice.finish_reason == ref.finish_reason


def test_completion_greedy_matches_llm_and_streams(api, model, llm):
    prompt = "The three primary colors are"
    ref = llm.generate(prompt, _greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    r = api.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    stream = api.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_chat_stream_equals_non_stream(api, model):
    whole = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0)
    chunks = list(api.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n_seed_and_logprobs(api, model):
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0.9, n=2, seed=7,
                                    logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                    reverse=True)
    again = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0.9, n=2, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = list(api.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.9,
                                           n=2, seed=3, stream=True))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_stop_echo_and_prompt_lists(api, model, llm):
    prompt = "The capital of France is"
    ref = llm.generate(prompt, _greedy(max_tokens=24), use_tqdm=False)[0].outputs[0].text
    word = ref.split()[2]  # a word from the middle of the greedy reply
    r = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[word])
    assert r.choices[0].text == ref[:ref.index(word)] and r.choices[0].finish_reason == "stop"
    echo = api.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert lp.text_offset == sorted(lp.text_offset)
    many = api.completions.create(model=model, prompt=[prompt, "1, 2, 3,"], max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == ref[:len(many.choices[0].text)]
    ids = api.completions.create(model=model, prompt=[[1, 2, 3]], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                        "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}


def test_structured_output(api, model):
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_* fields, streamed or not."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=96, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    chunks = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=96, temperature=0,
                                         response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=96, temperature=0,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = api.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                               extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert r.choices[0].text in ("Paris", "Lyon")
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", r.choices[0].message.content)
    r = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    for extra, message in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                            "response_format.json_schema.schema is required"),
                           ({"guided_regex": "a("}, "structured_outputs.regex cannot be compiled"),
                           ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, extra_body=extra)
        assert message in e.value.body["message"]


def test_predicted_outputs_draft_and_report_usage(server, api, model, llm):
    """OpenAI's `prediction`: the reply is what it is without one (greedy), usage counts the prediction's tokens
    that appear in the reply and the rest (OpenAI's accepted / rejected_prediction_tokens), streamed too, and the
    engine's speculative-decoding counters show the drafts it kept."""
    passage = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do."
    messages = [{"role": "user", "content": f'Copy this text:\n\n"""{passage}"""'}]
    plain = llm.chat(messages, _greedy(max_tokens=32), use_tqdm=False)[0].outputs[0].text
    r = api.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                    prediction={"type": "content", "content": passage})
    assert r.choices[0].message.content == plain
    details = r.usage.completion_tokens_details
    predicted = llm.get_tokenizer().encode(passage, add_special_tokens=False)
    assert 5 < details.accepted_prediction_tokens <= r.usage.completion_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(predicted)
    chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                              prediction={"type": "content", "content": passage}, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens_details == details
    assert metric_sum(_metrics(server.url), "ember_spec_decode_num_accepted_tokens_total") > 5
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                    prediction={"type": "text", "content": passage})
    assert "prediction" in e.value.body["message"]


def test_predictions_draft_for_a_schema_and_for_penalties(api, model):
    """A prediction drafts for a request whose reply follows a JSON schema and for one with penalties too: the reply
    is the one without a prediction, and predicted tokens are kept."""
    record = '{"city": "Paris", "population": 2148000}'
    messages = [{"role": "user", "content": f"Reply with this JSON object: {record}"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for extra in ({"response_format": fmt}, {"frequency_penalty": 0.5, "presence_penalty": 0.3}):
        plain = api.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, **extra)
        r = api.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                        prediction={"type": "content", "content": record}, **extra)
        assert r.choices[0].message.content == plain.choices[0].message.content, extra
        assert r.usage.completion_tokens_details.accepted_prediction_tokens > 3, (extra, r.choices[0].message.content)


def test_errors_are_openai_objects(server, api, model):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=QUESTION, temperature=5.0, top_p=0.0)
    assert e.value.body["param"] == "top_p" and "top_p" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:  # longer than max_model_len
        api.completions.create(model=model, prompt="hello " * 1100, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=QUESTION, logit_bias={"42": -100})
    assert e.value.body["param"] == "logit_bias" and "not supported" in e.value.body["message"]
    bad = asyncio.run(post(server.url, "/v1/chat/completions", b'{"messages": [', {}))
    assert bad.status == 400 and json.loads(bad.body)["error"]["code"] == "invalid_json"
    nan = asyncio.run(post(server.url, "/v1/completions", b'{"prompt": "x", "temperature": NaN}'))
    assert nan.status == 400 and json.loads(nan.body)["error"]["param"] == "temperature"
    huge = asyncio.run(post(server.url, "/v1/completions", b'{"prompt": "', declared_length=5 << 20))
    assert huge.status == 413 and json.loads(huge.body)["error"]["code"] == "request_too_large"


async def _flood(url: str, n: int, body: dict, leave_after: int | None = None) -> list:
    return await asyncio.gather(*(post(url, "/v1/chat/completions", body, leave_after_events=leave_after,
                                       timeout=600) for _ in range(n)))


def _raise_open_files(n: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def _metrics(url: str) -> str:
    return _get(url + "/metrics")[1]


def _idle(url: str, timeout: float = 60) -> str:
    """/metrics once no request is running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(url)
        busy = metric_sum(text, "ember_num_requests_running") + metric_sum(text, "ember_num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_thousand_streams_then_idle(server):
    _raise_open_files(4096)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "stream": True,
            "temperature": 0}
    asyncio.run(_flood(server.url, 40, body))  # the allocator's working set, before the baseline
    start_rss = rss_bytes(server.pid)
    answers = asyncio.run(_flood(server.url, 1000, body))
    ok = [a for a in answers if a.status == 200]
    busy = [a for a in answers if a.status == 503]
    assert len(ok) + len(busy) == 1000, {a.status for a in answers}
    assert ok and all(a.events[-1] == "[DONE]" for a in ok)
    assert all(json.loads(a.body)["error"]["code"] == "server_overloaded" and int(a.headers["retry-after"]) >= 1
               for a in busy)
    text = _idle(server.url)
    assert metric_sum(text, "ember_kv_cache_usage_perc") == 0.0
    assert metric_sum(text, "ember_server_requests_in_flight") == 0.0
    assert _get(server.url + "/health")[0] == 200
    grown = rss_bytes(server.pid) - start_rss
    print(f"1000 streams: {len(ok)} answered, {len(busy)} got 503; RSS {start_rss / 2**20:.0f} MiB -> "
          f"{rss_bytes(server.pid) / 2**20:.0f} MiB")
    assert grown < 150 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_clients_that_leave_abort(server):
    before = metric_sum(_metrics(server.url), "ember_request_success_total", finish_reason="abort")
    body = {"messages": QUESTION, "max_tokens": 512, "stream": True, "ignore_eos": True, "temperature": 0}

    async def leave() -> list:  # half leave after the first event (the role), half after two content tokens
        return await asyncio.gather(_flood(server.url, 100, body, leave_after=1),
                                    _flood(server.url, 100, body, leave_after=3))

    answers = [a for group in asyncio.run(leave()) for a in group]
    assert all(a.status == 200 for a in answers)
    deadline = time.monotonic() + 60
    while True:
        text = _metrics(server.url)
        aborted = metric_sum(text, "ember_request_success_total", finish_reason="abort") - before
        if aborted >= 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborted == 200
    text = _idle(server.url)
    assert metric_sum(text, "ember_kv_cache_usage_perc") == 0.0


_FIELDS = ["model", "messages", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "stream",
           "stream_options", "ignore_eos", "user", "tools", "prompt", "echo", "max_completion_tokens",
           "response_format", "guided_json", "guided_regex", "guided_choice"]
_weird = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
                   st.lists(st.integers(-5, 10**6), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                 max_size=2),
                   st.just([{"role": "user"}]), st.just([{"role": "robot", "content": "x"}]))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       changes=st.dictionaries(st.sampled_from(_FIELDS), _weird, min_size=1, max_size=3),
       drop=st.booleans(), raw=st.one_of(st.none(), st.binary(max_size=40), st.text(max_size=40)))
def test_fuzzed_bodies_get_4xx(fuzz_server, path, changes, drop, raw):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    body = {**base, "max_tokens": 2, **changes}
    if drop:
        body.pop("messages" if "chat" in path else "prompt", None)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) \
            and 8 < body["max_tokens"] < 2**31:
        body["max_tokens"] = 8  # a valid but long generation would only make the test slow
    payload = raw.encode() if isinstance(raw, str) else raw if raw is not None else json.dumps(body).encode()
    a = asyncio.run(post(fuzz_server.url, path, payload))
    assert a.status == 200 or 400 <= a.status < 500, (a.status, a.body[:300])
    if a.status >= 400:
        err = json.loads(a.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@pytest.fixture(scope="module")
def fuzz_server(server):
    yield server
    assert _get(server.url + "/health")[0] == 200  # still serving after the fuzz


def test_api_key_queue_full_and_sigterm():
    key = "s3cret-key"
    with running_server(*TEST_ENGINE_ARGS, "--api-key", key, "--max-queue", "0", "--max-num-seqs", "2") as srv:
        auth = {"Authorization": f"Bearer {key}"}
        body = {"prompt": "Count to one hundred:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        assert asyncio.run(post(srv.url, "/v1/completions", body)).status == 401
        wrong = asyncio.run(post(srv.url, "/v1/completions", body, {"Authorization": "Bearer s3cret-kez"}))
        assert wrong.status == 401 and json.loads(wrong.body)["error"]["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
        assert keyed.models.list().data
        assert _get(srv.url + "/health")[0] == 200  # probes need no key

        async def scenario():
            # two long streams fill both seats (the queue holds none): a third request is refused with 503
            streams = [asyncio.create_task(post(srv.url, "/v1/completions", body, auth)) for _ in range(2)]
            await asyncio.sleep(3)
            third = await post(srv.url, "/v1/completions", {**body, "stream": False}, auth)
            srv.proc.send_signal(signal.SIGTERM)  # the two in flight end with "abort", then the server stops
            return third, await asyncio.gather(*streams)

        third, streams = asyncio.run(scenario())
        assert third.status == 503 and "retry-after" in third.headers
        for s in streams:
            assert s.status == 200 and s.events[-1] == "[DONE]"
            assert json.loads(s.events[-2])["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(60) == 0
        assert "server stopped" in srv.log()
