"""OpenAI's Responses API through ``ember serve``, driven by the openai client unchanged (``responses.create``,
``responses.stream``, retrieve / delete / cancel / input_items) and by an openai-agents SDK agent on its default,
Responses-based model. The tiny random model (``server_utils.hermes_model``) rarely stops by itself, so the
answers that must complete are constrained (a JSON enum, a required tool call)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import jsonschema
import openai
import pytest
from server_utils import TEST_ENGINE_ARGS, hermes_model, metric_sum, post, running_server

from ember.server.response_store import ResponseStore, StoredResponse

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
YES_NO = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}


@pytest.fixture(scope="module")
def server(tokenizer_dir, tmp_path_factory):
    model = hermes_model(tokenizer_dir, str(tmp_path_factory.mktemp("responses-model")))
    with running_server(model, *TEST_ENGINE_ARGS, "--max-stored-responses", "50") as srv:
        yield srv


def test_text_equals_the_chat_endpoints_greedy_answer(api, model):
    r = api.responses.create(model=model, input="Hello there", instructions="Be brief.", max_output_tokens=12,
                             temperature=0)
    chat = api.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hello there"}],
                                       max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.id.startswith("resp_") and r.output[0].type == "message" and r.output[0].id.startswith("msg_")


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(api, model):
    ask = "Tell me about Oslo, the capital of Norway: its history, its museums, its fjord and its food."
    first = api.responses.create(model=model, input=ask, max_output_tokens=20, temperature=0)
    second = api.responses.create(model=model, input="And Paris?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the first turn's prompt blocks, reused
    turn = [{"role": "user", "content": ask}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And Paris?"}]
    chat = api.chat.completions.create(model=model, messages=turn, max_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content  # the same conversation, rendered the same


def test_stream_events_in_order_and_the_stream_helper(api, model):
    events = list(api.responses.create(model=model, input="Stream it", max_output_tokens=10, temperature=0,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and text
    with api.responses.stream(model=model, input="Yes or no?", text=YES_NO, temperature=0,
                              max_output_tokens=10) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text) in ("yes", "no")
    assert "".join(deltas) == final.output_text


def test_function_tools_calls_and_their_outputs(api, model):
    r = api.responses.create(model=model, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with api.responses.stream(model=model, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=60, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output] == [(call.name, call.arguments)] and deltas == call.arguments
    follow = api.responses.create(model=model, previous_response_id=r.id, tools=TOOLS, max_output_tokens=6,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                         "output": "-3 C and snow"}])
    assert follow.usage.input_tokens_details.cached_tokens > 0 and follow.output_text
    named = api.responses.create(model=model, input="Weather?", tools=TOOLS, max_output_tokens=60, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]


def test_store_retrieve_delete_and_input_items(api, model):
    r = api.responses.create(model=model, input="Keep me", max_output_tokens=4, temperature=0)
    assert api.responses.retrieve(r.id).output_text == r.output_text
    items = api.responses.input_items.list(r.id).data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Keep me")]
    api.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(r.id)
    gone = api.responses.create(model=model, input="Forget me", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        api.responses.create(model=model, input="x", previous_response_id="resp_nope", max_output_tokens=4)


def test_background_runs_to_the_end_and_cancel_frees_its_blocks(server, api, model):
    done = api.responses.create(model=model, input="In the background", background=True, max_output_tokens=16,
                                temperature=0)
    assert done.status in ("queued", "in_progress")
    for _ in range(300):
        got = api.responses.retrieve(done.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert got.status == "incomplete" and got.usage.output_tokens == 16 and got.output_text
    long = api.responses.create(model=model, input="Go on and on", background=True, max_output_tokens=900,
                                temperature=0)
    assert api.responses.cancel(long.id).status == "cancelled"  # at once: the tiny model makes 900 tokens in 1 s
    for _ in range(100):
        if metric_sum(_get(server.url + "/metrics"), "ember_kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert metric_sum(_get(server.url + "/metrics"), "ember_kv_cache_usage_perc") == 0
    assert api.responses.retrieve(long.id).status == "cancelled"
    gone = api.responses.create(model=model, input="Delete me at work", background=True, max_output_tokens=900)
    api.responses.delete(gone.id)
    time.sleep(1.5)  # its run ends (aborted) and must not store it again
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(gone.id)


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_bad_bodies_name_the_field(server):
    cases = [({"input": "x", "background": True, "store": False}, 400, "background=true needs store=true"),
             ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning is not supported"),
             ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
             ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400,
              "tool_choice.name='nope'"),
             ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "call_id"),
             ({"input": "x", "temperature": "hot"}, 400, "temperature"),
             ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type")]
    for body, status, why in cases:
        answer = asyncio.run(post(server.url, "/v1/responses", body))
        assert answer.status == status and why in json.loads(answer.body)["error"]["message"], (body, answer.body)


def test_an_agents_sdk_agent_on_the_responses_api(server, model):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    seen = []

    # offered until it ran once: a random model given the choice might call it on every turn
    @function_tool(is_enabled=lambda ctx, agent: not seen)
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"-3 C in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    # the answer's type makes the second turn a JSON schema the random model completes (text.format)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0.0),
                  output_type=Literal["sunny", "snowy"])
    result = Runner.run_sync(agent, "Weather in Oslo?", max_turns=4, run_config=RunConfig(tracing_disabled=True))
    assert seen and set(seen) <= {"Oslo", "Paris"}, result.new_items  # the tool ran with its parsed argument
    assert result.final_output in ("sunny", "snowy")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_the_store_is_bounded_in_number_and_bytes():
    store = ResponseStore(max_responses=3, max_bytes=2_000)
    for i in range(5):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": "x" * 100}]))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # used: kept over r3
    store.put("big", StoredResponse({"id": "big"}, [{"role": "user", "content": "y" * 1_500}]))
    assert store.get("r2") is not None and store.get("r3") is None and store.bytes <= 2_000
    store.put("huge", StoredResponse({"id": "huge"}, [{"role": "user", "content": "z" * 5_000}]))
    assert store.get("huge") is None  # larger than the whole bound: not kept
    assert store.delete("r2") and not store.delete("r2") and len(store) < 3
