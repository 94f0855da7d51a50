"""Tool calling and reasoning through ``ember serve``, by the real clients people use: the openai client, LangChain's
``ChatOpenAI.bind_tools`` and an openai-agents SDK agent.

The model is a random-initialised tiny Llama whose tokenizer carries a Hermes-style chat template
(``server_utils.hermes_model``). A random model
never chooses a tool by itself, so the calls here come from ``tool_choice`` "required" or a named function: every
one must parse and follow its function's JSON schema (checked with jsonschema).
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from server_utils import TEST_ENGINE_ARGS, hermes_model, post, running_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 30}, "tags": {
    "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}, "required": ["text"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "save_note", "description": "Save a note", "parameters": NOTE}}]
SCHEMAS = {"get_weather": WEATHER, "save_note": NOTE}
ASK = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]


@pytest.fixture(scope="module")
def tool_model(tokenizer_dir, tmp_path_factory) -> str:
    return hermes_model(tokenizer_dir, str(tmp_path_factory.mktemp("tool-model")))


@pytest.fixture(scope="module")
def server(tool_model):
    with running_server(tool_model, *TEST_ENGINE_ARGS) as srv:
        yield srv


def _post(server, path: str, body: dict):
    return asyncio.run(post(server.url, path, body))


def _check_calls(calls, allowed=("get_weather", "save_note")) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_are_valid_and_follow_their_schemas(api):
    """80 calls sampled at temperature 1 (10 requests of n = 8): every finished one parses and follows its schema
    (a random model often runs to max_tokens inside a string; the real model's figure is in docs/server.md)."""
    model = api.models.list().data[0].id
    finished = 0
    for seed in range(10):
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "save_note"}}
        r = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, n=8, seed=seed,
                                        temperature=1.0, max_tokens=120, parallel_tool_calls=False)
        for c in r.choices:
            assert c.message.content is None and len(c.message.tool_calls) == 1  # parallel_tool_calls=False: one
            if c.finish_reason == "length":  # cut inside its arguments: named, not complete
                assert c.message.tool_calls[0].function.name in SCHEMAS
                continue
            assert c.finish_reason == "tool_calls"
            _check_calls(c.message.tool_calls, ("get_weather", "save_note") if seed % 2 else ("save_note",))
            finished += 1
    assert finished >= 20


def test_auto_with_a_response_format_answers_with_calls_or_that_json(api):
    """tool_choice auto with a JSON schema format: every finished reply is valid calls or a valid answer."""
    model = api.models.list().data[0].id
    answer = {"type": "object", "properties": {"weather": {"enum": ["sunny", "snowy"]}}, "required": ["weather"],
              "additionalProperties": False}
    kinds = set()
    for seed in range(4):
        r = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, n=4, seed=seed, temperature=1.0,
                                        max_tokens=120, parallel_tool_calls=False, response_format={
                                            "type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
        for c in r.choices:
            if c.finish_reason == "length":
                continue
            if c.message.tool_calls:
                _check_calls(c.message.tool_calls)
                kinds.add("call")
            else:
                jsonschema.validate(json.loads(c.message.content), answer)
                kinds.add("answer")
    assert kinds  # at least one finished reply, each of them valid


def test_streamed_calls_follow_openais_shape_and_equal_the_whole_answer(api):
    body = dict(model=api.models.list().data[0].id, messages=ASK, tools=TOOLS, tool_choice="required",
                temperature=0.0, max_tokens=200, parallel_tool_calls=False)
    whole = api.chat.completions.create(**body).choices[0]
    _check_calls(whole.message.tool_calls)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in api.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for tc in delta.tool_calls or []:
            assert len(delta.tool_calls) == 1  # one call entry a chunk, as OpenAI streams them
            if tc.id is not None:  # the first: id, type and name once, empty arguments
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_conversation_with_calls_and_results_renders(server, api):
    model = api.models.list().data[0].id
    first = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                        temperature=0.0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    turn = ASK + [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}]
    tokens = _post(server, "/tokenize", {"messages": turn})
    assert tokens.status == 200
    rendered = json.loads(_post(server, "/detokenize", {"tokens": json.loads(tokens.body)["tokens"]}).body)["prompt"]
    # the arguments are rendered as the object they are (OpenAI clients send them as JSON text)
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments), ensure_ascii=False)}' in rendered
    assert "<tool_response>\n-3 C\n</tool_response>" in rendered
    second = api.chat.completions.create(model=model, messages=turn, tools=TOOLS, temperature=0.0, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_errors_name_the_field(server):
    cases = [
        ({"tool_choice": "required"}, "tool_choice='required' needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name='nope' is not one of"),
        ({"tools": TOOLS + TOOLS[:1]}, "is given twice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "a request takes at most one constraint"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "cannot be compiled"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions is not supported"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs sets tools"),
        ({"tools": TOOLS, "tool_choice": "required", "thinking_token_budget": 4}, "no thinking to limit"),
        ({"chat_template_kwargs": {"bos_token": "x", "continue_final_message": True}},
         "chat_template_kwargs sets bos_token, continue_final_message"),
    ]
    for extra, why in cases:
        answer = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
        assert answer.status == 400 and why in json.loads(answer.body)["error"]["message"], (extra, answer.body)
    bad_turn = ASK + [{"role": "tool", "content": "x"}]
    answer = _post(server, "/v1/chat/completions", {"messages": bad_turn, "max_tokens": 4})
    assert answer.status == 400 and b"tool_call_id is required" in answer.body


def test_reasoning_goes_to_reasoning_content(api):
    """enable_thinking opens <think> in the prompt: the reply (cut by max_tokens, no end tag) is all reasoning;
    without it the reply is content; with a thinking budget the end tag comes after that many tokens and the
    answer follows."""
    model = api.models.list().data[0].id
    body = dict(model=model, messages=ASK, temperature=0.0, max_tokens=12)
    plain = api.chat.completions.create(**body).choices[0].message
    thinking = api.chat.completions.create(**body, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = thinking.choices[0].message
    assert getattr(plain, "reasoning_content", None) is None and plain.content
    assert message.reasoning_content and not message.content
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in
                       api.chat.completions.create(**body, stream=True,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    assert streamed == message.reasoning_content
    budget = api.chat.completions.create(**body, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                             "thinking_token_budget": 2})
    usage, message = budget.usage, budget.choices[0].message
    assert message.reasoning_content and message.content  # the end tag was forced after two tokens of thought
    assert usage.completion_tokens == 12


def test_langchain_bind_tools_gets_tool_calls(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="any", temperature=0, max_tokens=120,
                     max_retries=0)
    llm.model_name = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list().data[0].id
    reply = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"], (reply.invalid_tool_calls, reply.response_metadata)
    jsonschema.validate(reply.tool_calls[0]["args"], WEATHER)
    chunks = list(llm.bind_tools(TOOLS, tool_choice="required").stream("Weather in Oslo?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.tool_calls and merged.tool_calls[0]["name"] in SCHEMAS


def test_an_openai_agents_sdk_agent_runs_its_tool(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    seen = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:  # an enum: a random model's strings run long
        """The weather in a city."""
        seen.append(city)
        return f"-3 C in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model_id = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").models.list().data[0].id
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model_id, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0.0))
    result = Runner.run_sync(agent, "Weather in Oslo?", max_turns=4, run_config=RunConfig(tracing_disabled=True))
    assert seen and set(seen) <= {"Oslo", "Paris"}, result.new_items  # the tool ran with its parsed argument
    assert isinstance(result.final_output, str)
