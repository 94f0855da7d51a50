"""OpenAI's Responses API over the chat machinery: ``POST /v1/responses`` (streamed or not, in the background or
not), ``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``GET .../input_items``.

A request becomes a chat request (``to_chat``: instructions as the system message, the stored conversation of
``previous_response_id``, this turn's input items; function tools, ``tool_choice`` and ``text.format`` mapped onto
their chat fields), so templates, tool parsing, structured output and sampling are the chat endpoint's own. The
reply is read by the same ``ReplyParser``; ``ResponseEvents`` turns its deltas into output items (reasoning, message,
function calls) and the typed stream events the openai client expects, and the final Response object is what those
events built. A stored conversation renders to the same prompt tokens next turn, so the prefix cache serves them.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember.errors import BadRequestError
from ember.outputs import RequestOutput
from ember.server.errors import APIError, engine_errors, from_engine, is_engine_error
from ember.server.http_io import EventStream, unless_left
from ember.server.protocol import ChatCompletionRequest
from ember.server.reply import ReplyFormat
from ember.server.response_store import ResponseStore, StoredResponse
from ember.server.responses_protocol import FunctionCallItem, FunctionCallOutput, Message, ResponsesRequest
from ember.server.streams import collect
from ember.server.translate import prepared_chat_request


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input items as chat messages: consecutive function calls become one assistant message with
    their tool calls, a call's output a tool message."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, Message):
            out.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This turn's input as the items ``GET .../input_items`` lists: a message's text as an ``input_text`` part."""
    given = [Message(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out = []
    for item in given:
        fields = item.model_dump(exclude_none=True, by_alias=True)
        if isinstance(item, Message) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            fields["content"] = [{"type": kind, "text": item.content}]
        out.append({"status": "completed", **fields})
    return out


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this Responses request is: the same model, sampling, tools and constraint."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
        history + input_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as e:  # an input item the chat shapes refuse (a tool output without its call's id, ...)
        raise BadRequestError(f"input cannot be read as a conversation: {e}") from None


# chat field names in messages -> the Responses body's names
_FIELDS = (("max_completion_tokens", "max_output_tokens"), ("tool_choice.function.name", "tool_choice.name"),
           ("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
           ("messages", "input"), (".function.name", ".name"))


def _renamed(e: BadRequestError) -> BadRequestError:
    text = str(e)
    for chat, responses in _FIELDS:
        text = text.replace(chat, responses)
    return BadRequestError(text)


class ResponseEvents:
    """One response's output items and stream events, built from its reply parser's chat deltas."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the output item now open
        self.calls: dict[int, dict[str, Any]] = {}  # the reply's tool-call index -> its function_call item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def lifecycle(self, kind: str) -> dict[str, Any]:
        return self.event(kind, response=copy.deepcopy(self.body))

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.item = item
        self.body["output"].append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.body["output"]) - 1,
                                 item=copy.deepcopy(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.body["output"]) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.item = self.item, None
        if item is None:
            return []
        index = self.body["output"].index(item)
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return events

    def feed(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta in the text's order: arguments of calls already open (nothing can precede
        them), reasoning, content, then new calls."""
        calls = fields.get("tool_calls", ())
        events = self._calls([c for c in calls if "id" not in c and c["index"] in self.calls])
        if fields.get("reasoning_content"):
            if self.item is None or self.item["type"] != "reasoning":
                events += self._open({"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                                      "content": [{"type": "reasoning_text", "text": ""}]})
            self.item["content"][0]["text"] += fields["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.item["id"],
                                     output_index=len(self.body["output"]) - 1, content_index=0,
                                     delta=fields["reasoning_content"]))
        if fields.get("content"):
            if self.item is None or self.item["type"] != "message":
                events += self._open({"id": _id("msg"), "type": "message", "role": "assistant",
                                      "status": "in_progress", "content": []})
            self.item["content"][0]["text"] += fields["content"]
            events.append(self.event("response.output_text.delta", item_id=self.item["id"],
                                     output_index=len(self.body["output"]) - 1, content_index=0,
                                     delta=fields["content"], logprobs=[]))
        return events + self._calls([c for c in calls if "id" in c or c["index"] not in self.calls])

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for call in calls:
            if "id" in call:
                self.calls[call["index"]] = item = {"id": _id("fc"), "type": "function_call",
                                                    "call_id": call["id"], "name": call["function"]["name"],
                                                    "arguments": "", "status": "in_progress"}
                events += self._open(item)
            delta = call["function"]["arguments"]
            if delta:
                item = self.calls[call["index"]]
                item["arguments"] += delta
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.body["output"].index(item), delta=delta))
        return events

    def finish(self, reason: str | None, usage: dict[str, Any], cancelled: bool = False) -> list[dict[str, Any]]:
        """Close the open item and settle the response: completed, incomplete (max_output_tokens), cancelled (an
        abort its cancel or delete asked for) or failed (any other abort: the server shutting down)."""
        cut = reason == "length"
        events = self.close("incomplete" if cut else "completed")
        status = {"length": "incomplete", "abort": "cancelled" if cancelled else "failed"}.get(reason or "",
                                                                                              "completed")
        self.body.update(status=status, usage=usage,
                         incomplete_details={"reason": "max_output_tokens"} if cut else None)
        if status == "failed":
            self.body["error"] = {"code": "server_error", "message": "the request was aborted before it ended (the "
                                                                     "server is shutting down)"}
        if status != "cancelled":
            kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(status, "response.completed")
            events.append(self.lifecycle(kind))
        return events


def _usage(out: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


def _skeleton(rid: str, req: ResponsesRequest, model: str, status: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "background":
            req.background, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format
            else {"format": {"type": "text"}},
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else
                            req.tool_choice.model_dump()) if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "truncation": "disabled",
            "usage": None, "user": req.user, "metadata": req.metadata or {}}


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class _Turn:
    """One response being made: its events, reply parser, and what to store when it ends."""

    def __init__(self, body: dict[str, Any], reply: ReplyFormat, tokenizer: Any, conversation: list[dict],
                 items: list[dict]) -> None:
        self.events, self.parser, self.tokenizer = ResponseEvents(body), reply.parser(), tokenizer
        self.conversation, self.items = conversation, items

    def feed(self, delta: RequestOutput) -> list[dict[str, Any]]:
        events = []
        for o in delta.outputs:
            events += self.events.feed(self.parser.feed(o.text, final=o.finish_reason is not None))
        return events

    def finish(self, final: RequestOutput, cancelled: bool = False) -> list[dict[str, Any]]:
        thought = self.parser.thought
        tokens = len(self.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return self.events.finish(final.outputs[0].finish_reason, _usage(final, tokens), cancelled)

    def stored(self) -> StoredResponse:
        """The conversation after this turn: its messages, then the reply as an assistant message (the
        instructions are not carried over, as OpenAI's previous_response_id does not carry them)."""
        reply = {k: v for k, v in self.parser.message().items() if v is not None and k != "reasoning_content"}
        return StoredResponse(self.events.body, [*self.conversation, reply], self.items)


def install(app: FastAPI, state: Any) -> None:
    """The routes, over the server's state (``app.ServerState``; its ``responses`` store)."""
    store: ResponseStore = state.responses

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Response:
        engine, lora, model = state.route(req.model)
        if req.include:
            raise APIError(400, f"include={req.include!r} is not supported: ember's responses carry no extra "
                                "fields (send [] or leave it out)", param="include")
        if req.background and not req.store:
            raise APIError(400, "background=true needs store=true: a background response is fetched later",
                           param="background")
        if req.background and req.stream:
            raise APIError(400, "background=true with stream=true is not supported: stream, or poll a background "
                                "response", param="stream")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise APIError(404, f"previous_response_id={req.previous_response_id!r} is not a stored response",
                               param="previous_response_id", code="response_not_found")
            if prev.body["status"] in ("queued", "in_progress"):
                raise APIError(400, f"previous_response_id={req.previous_response_id!r} is still "
                                    f"{prev.body['status']}", param="previous_response_id")
            history = prev.conversation
        rid = _id("resp")
        group = state.group(engine, "resp")
        with engine_errors("input"):
            try:
                chat = to_chat(req, history)
                prompt, params, reply = await prepared_chat_request(engine.client, chat, engine.tool_parser,
                                                                    engine.thinks)
            except BadRequestError as e:
                raise _renamed(e) from None
            group.submit([prompt], params, lora)
        conversation = [m.model_dump(exclude_none=True) for m in chat.messages[1 if req.instructions is not None
                                                                                else 0:]]
        items = input_items(req)
        turn = _Turn(_skeleton(rid, req, model, "in_progress"), reply, engine.client.tokenizer, conversation, items)
        if req.stream:
            return EventStream(_stream(turn, group, store if req.store else None), group.close)
        if req.background:
            turn.events.body["status"] = "queued"
            stored = turn.stored()
            stored.run = BackgroundRun(group)
            store.put(rid, stored)
            stored.run.task = asyncio.ensure_future(_background(turn, stored.run, store))
            return JSONResponse(turn.events.body)
        finals = await unless_left(request, group, collect(group))
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        turn.feed(final)
        turn.finish(final)
        if req.store:
            store.put(rid, turn.stored())
        return JSONResponse(turn.events.body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return _stored(store, response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        stored = _stored(store, response_id)
        store.delete(response_id)
        if stored.run is not None:  # a run at work stops, and does not store it again when it ends
            stored.run.cancel(delete=True)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict:
        stored = _stored(store, response_id)
        if not stored.body.get("background"):
            raise APIError(400, f"response {response_id!r} was not created with background=true: only a background "
                                "response can be cancelled", param="response_id")
        run = stored.run
        if run is not None:  # still at work: abort its engine request (its KV blocks are freed), await its end
            run.cancel()
            await asyncio.wait({run.task}, timeout=30)
        return (store.get(response_id) or stored).body

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str) -> dict:
        items = _stored(store, response_id).input_items
        data = [{"id": item.get("id") or f"item_{response_id}_{i}", **item} for i, item in enumerate(items)]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"response {response_id!r} is not stored (never made, store=false, deleted, or dropped "
                            "from the bounded store)", param="response_id", code="response_not_found")
    return stored


async def _stream(turn: _Turn, group: Any, store: ResponseStore | None) -> AsyncIterator[str]:
    events = turn.events
    yield _sse(events.lifecycle("response.created"))
    yield _sse(events.lifecycle("response.in_progress"))
    final: RequestOutput | None = None
    try:
        async for _, delta in group.deltas():
            if final is None:
                final = delta
            else:
                final.merge(delta)
            for event in turn.feed(delta):
                yield _sse(event)
    except Exception as e:
        error = (from_engine(e, "input") if is_engine_error(e) else
                 APIError(500, f"internal error: {type(e).__name__}: {e}")).body()["error"]
        for event in events.close("incomplete"):
            yield _sse(event)
        events.body.update(status="failed", error={"code": error.get("code") or "server_error",
                                                   "message": error["message"]})
        yield _sse(events.lifecycle("response.failed"))
        return
    last = turn.finish(final)
    if store is not None:  # stored before the last events go out: a retrieve right after the stream finds it
        store.put(events.body["id"], turn.stored())
    for event in last:
        yield _sse(event)


class BackgroundRun:
    """A background response at work: its engine requests, the task reading them, whether a cancel asked."""

    __slots__ = ("group", "task", "cancelled", "deleted")

    def __init__(self, group: Any) -> None:
        self.group, self.task, self.cancelled, self.deleted = group, None, False, False

    def cancel(self, delete: bool = False) -> None:
        self.cancelled, self.deleted = True, self.deleted or delete
        self.group.abort()


async def _background(turn: _Turn, run: BackgroundRun, store: ResponseStore) -> None:
    """Run a background response to its end, its stored body current as the deltas come (a retrieve shows the
    text so far); stored again at the end with its new size, unless it was deleted meanwhile."""
    rid = turn.events.body["id"]
    turn.events.body["status"] = "in_progress"
    final: RequestOutput | None = None
    try:
        async for _, delta in run.group.deltas():
            turn.feed(delta)
            if final is None:
                final = delta
            else:
                final.merge(delta)
        turn.finish(final, run.cancelled)
    except Exception as e:  # the engine stopped: the response failed
        turn.events.body.update(status="failed", error={"code": "server_error", "message": str(e)})
    finally:
        run.group.close()
    if not run.deleted:
        store.put(rid, turn.stored())
