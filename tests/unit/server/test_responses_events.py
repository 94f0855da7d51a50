"""The Responses API's stream events and Response object validate as the openai SDK's own models (every field it
requires, typed as it types them), in OpenAI's order, for text, reasoning and function calls."""

from __future__ import annotations

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ember.server.responses_api import ResponseEvents, _skeleton, input_messages, to_chat
from ember.server.responses_protocol import ResponsesRequest

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0}, "output_tokens": 6,
         "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 16}


def _events(req: dict, deltas: list[dict], reason: str) -> tuple[list, Response]:
    body = ResponsesRequest.model_validate({"input": "hi", **req})
    em = ResponseEvents(_skeleton("resp_1", body, "m", "in_progress"))
    events = [em.lifecycle("response.created"), em.lifecycle("response.in_progress")]
    for d in deltas:
        events += em.feed(d)
    events += em.finish(reason, USAGE)
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    return parsed, Response.model_validate(em.body)


def test_text_events_and_the_final_response():
    parsed, final = _events({}, [{"content": "Hel"}, {"content": "lo"}], "stop")
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert final.output_text == "Hello" and final.status == "completed" and parsed[-1].response.output_text == "Hello"
    assert final.usage.input_tokens_details.cached_tokens == 4


def test_reasoning_then_calls_and_an_incomplete_end():
    tools = [{"type": "function", "name": "w", "parameters": {"type": "object"}}]
    deltas = [{"reasoning_content": "think"}, {"content": "Let me look."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "w", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    parsed, final = _events({"tools": tools}, deltas, "length")
    kinds = [e.type for e in parsed]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.incomplete"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert (call.call_id, call.name, call.arguments, call.status) == ("call_1", "w", '{"a": 1}', "incomplete")
    assert final.incomplete_details.reason == "max_output_tokens"


def test_input_items_become_a_chat_conversation():
    req = ResponsesRequest.model_validate({"instructions": "be brief", "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "terse"}]},
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]}]})
    assert input_messages(req) == [
        {"role": "developer", "content": "terse"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}]
    chat = to_chat(req, [{"role": "user", "content": "earlier"}])
    assert [m.role for m in chat.messages] == ["system", "user", "developer", "user", "assistant", "tool", "assistant"]


def test_an_abort_is_cancelled_only_when_a_cancel_asked():
    body = ResponsesRequest.model_validate({"input": "hi", "background": True})
    for cancelled, status in ((True, "cancelled"), (False, "failed")):
        em = ResponseEvents(_skeleton("resp_1", body, "m", "in_progress"))
        events = em.feed({"content": "par"}) + em.finish("abort", USAGE, cancelled)
        assert Response.model_validate(em.body).status == status
        assert [EVENT.validate_python(e).type for e in events][-1] == (
            "response.output_item.done" if cancelled else "response.failed")
    assert Response.model_validate(em.body).error.code == "server_error"


def test_an_open_calls_arguments_come_before_the_content_after_it():
    """One delta may end a call and carry the content after it: the call's arguments go first, so the call item
    is closed whole and the message after it opens as the text has them."""
    start = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "w", "arguments": '{"a": '}}]}
    rest = {"content": "Done.", "tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}
    parsed, final = _events({}, [start, rest], "stop")
    done = [e for e in parsed if e.type == "response.function_call_arguments.done"]
    assert [o.type for o in final.output] == ["function_call", "message"] and done[0].arguments == '{"a": 1}'
    assert final.output[0].arguments == '{"a": 1}' and final.output_text == "Done."


def test_a_background_response_at_work_is_never_dropped():
    from ember.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(max_responses=2, max_bytes=10_000)
    store.put("running", StoredResponse({"id": "running"}, [], run=object()))
    for i in range(4):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, []))
    assert store.get("running") is not None and store.get("r3") is not None and len(store) == 2
