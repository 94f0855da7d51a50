"""A request group's deltas as OpenAI answers: the final body of a non-streamed request (``collect`` and the
choice builders) and the Server-Sent Events of a streamed one (``chat_stream``, ``completion_stream``). An engine
error after the stream started goes out as an error event, then ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ember.frontend.client import EngineClient
from ember.outputs import CompletionOutput, RequestOutput
from ember.server import responses as R
from ember.server.errors import APIError, from_engine, is_engine_error
from ember.server.group import RequestGroup
from ember.server.reply import ReplyFormat


async def collect(group: RequestGroup) -> list[RequestOutput]:
    """Every request's final cumulative output, in prompt order."""
    finals: list = [None] * len(group.ids)
    async for i, delta in group.deltas():
        if finals[i] is None:
            finals[i] = delta
        else:
            finals[i].merge(delta)
    return finals


def completion_choice(index: int, out: RequestOutput, o: CompletionOutput, logprobs: int | None, echo: bool,
                      client: EngineClient) -> dict:
    prompt_text = _prompt_text(out, client) if echo else ""
    lp = None
    if logprobs is not None:
        ids, positions = list(o.token_ids), list(o.logprobs or [])
        if echo:
            ids = list(out.prompt_token_ids) + ids
            positions = _prompt_positions(out.prompt_token_ids, out.prompt_logprobs, client) + positions
        lp = R.completion_logprobs(ids, positions, logprobs, 0)
    return {"index": index, "text": prompt_text + o.text, "logprobs": lp, "finish_reason": o.finish_reason}


def _prompt_text(out: RequestOutput, client: EngineClient) -> str:
    return out.prompt if out.prompt is not None else client.tokenizer.decode(out.prompt_token_ids)


def _prompt_positions(prompt_token_ids: list[int], prompt_logprobs: list | None, client: EngineClient) -> list:
    """Prompt logprobs for echo: the first token has none; missing decoded tokens are filled in."""
    positions = list(prompt_logprobs or [None] * len(prompt_token_ids))
    positions[0] = None
    for tid, pos in zip(prompt_token_ids, positions):
        if pos is not None and tid in pos and pos[tid].decoded_token is None:
            pos[tid].decoded_token = client.tokenizer.decode([tid])
    return positions


async def chat_stream(group: RequestGroup, created: int, model: str, n: int, top: int | None,
                      usage: bool, predicted: bool = False, reply: ReplyFormat = ReplyFormat()) -> AsyncIterator[str]:
    """A chat request's chunks: each choice's text read as content, reasoning and tool-call deltas (reply) as it
    comes, so every chunk holds only what no later token can change."""
    rid = group.request_id
    parsers = [reply.parser() for _ in range(n)]
    for i in range(n):  # the role comes first, as OpenAI sends it
        yield R.sse(R.chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None,
                                 with_usage=usage))
    completion_tokens, prompt_tokens, last = 0, 0, None
    try:
        async for _, delta in group.deltas():
            prompt_tokens, last = len(delta.prompt_token_ids), delta
            for o in delta.outputs:
                completion_tokens += len(o.token_ids)
                if not o.text and not o.finish_reason and not o.token_ids:
                    continue
                parser = parsers[o.index]
                fields = parser.feed(o.text, final=o.finish_reason is not None)
                lp = R.chat_logprobs(o.token_ids, o.logprobs or [], top) if top is not None else None
                if fields or lp is not None or o.finish_reason:
                    parts = parser.chunks(fields)
                    for k, part in enumerate(parts):  # logprobs with the first, the finish reason with the last
                        yield R.sse(R.chat_chunk(rid, created, model, o.index, part,
                                                 parser.finish_reason(o.finish_reason) if k == len(parts) - 1
                                                 else None, lp if k == 0 else None, usage))
    except Exception as e:
        yield R.sse(from_engine(e, "messages").body() if is_engine_error(e) else
                    APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    else:
        if usage:
            yield R.sse(R.usage_chunk(rid, created, model, "chat.completion.chunk", prompt_tokens, completion_tokens,
                                      R.prediction_counts(last, predicted) if last is not None else None))
    yield R.DONE


async def completion_stream(group: RequestGroup, created: int, model: str, n: int, logprobs: int | None,
                             echo: bool, usage: bool, client: EngineClient) -> AsyncIterator[str]:
    rid = group.request_id
    prompt_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}  # choice index -> characters sent so far (logprobs' text_offset)
    prompt_logprobs: dict[int, list] = {}  # they come once per prompt, with its first delta
    completion_tokens = 0
    try:
        async for i, delta in group.deltas():
            prompt_tokens[i] = len(delta.prompt_token_ids)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[i] = delta.prompt_logprobs
            for o in delta.outputs:
                index = i * n + o.index
                completion_tokens += len(o.token_ids)
                text, ids, positions = o.text, list(o.token_ids), list(o.logprobs or [])
                if echo and index not in offsets:  # the prompt goes out with the first chunk of each choice
                    text = _prompt_text(delta, client) + text
                    if logprobs is not None:
                        ids = list(delta.prompt_token_ids) + ids
                        positions = _prompt_positions(delta.prompt_token_ids, prompt_logprobs.get(i),
                                                      client) + positions
                if not text and not o.finish_reason and not ids:
                    continue
                start = offsets.get(index, 0)
                lp = R.completion_logprobs(ids, positions, logprobs, start) if logprobs is not None else None
                offsets[index] = start + len(text)
                yield R.sse(R.completion_chunk(rid, created, model, index, text, o.finish_reason, lp, usage))
    except Exception as e:
        yield R.sse(from_engine(e, "prompt").body() if is_engine_error(e) else
                    APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    else:
        if usage:
            yield R.sse(R.usage_chunk(rid, created, model, "text_completion", sum(prompt_tokens.values()),
                                      completion_tokens))
    yield R.DONE
