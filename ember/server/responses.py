"""ember outputs -> OpenAI response bodies and stream chunks (chat.completion, chat.completion.chunk,
text_completion), with OpenAI's logprobs shapes and usage."""

from __future__ import annotations

import json
from typing import Any

from ember.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ember.server.reply import ReplyFormat

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage; prediction: (accepted, rejected) prediction tokens of a request with a predicted output."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if prediction is not None:
        accepted, rejected = prediction
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": rejected}
    return out


def prediction_counts(out: RequestOutput, predicted: bool) -> tuple[int, int] | None:
    """(accepted, rejected) prediction tokens of a request that sent one, from its final output's metrics."""
    if not predicted:
        return None
    m = out.metrics
    if m is None or m.accepted_prediction_tokens is None or m.rejected_prediction_tokens is None:
        return 0, 0
    return m.accepted_prediction_tokens, m.rejected_prediction_tokens


def _token(pos: PositionLogprobs, tid: int) -> str:
    lp = pos.get(tid)
    return (lp.decoded_token if lp is not None and lp.decoded_token is not None else "") or ""


def _top(pos: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    return sorted(((t, lp) for t, lp in pos.items() if lp.rank <= k), key=lambda x: x[1].rank)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``, one per token."""
    content = []
    for tid, pos in zip(token_ids, positions):
        text = _token(pos, tid)
        content.append({"token": text, "logprob": pos[tid].logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())}
                                         for _, lp in _top(pos, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], k: int,
                        offset: int) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}``; a position without logprobs (the first prompt
    token under echo) has null; offsets count characters from ``offset``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, pos in zip(token_ids, positions):
        text = _token(pos, tid) if pos is not None else ""
        out["tokens"].append(text)
        out["token_logprobs"].append(pos[tid].logprob if pos is not None else None)
        out["top_logprobs"].append({lp.decoded_token or "": lp.logprob for _, lp in _top(pos, k)}
                                   if pos is not None else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_choice(o: CompletionOutput, top_logprobs: int | None, reply: ReplyFormat = ReplyFormat()) -> dict[str, Any]:
    """A finished choice: its text read as content, reasoning and tool calls (reply)."""
    parser = reply.parser()
    parser.feed(o.text, final=True)
    return {"index": o.index, "message": parser.message(),
            "logprobs": chat_logprobs(o.token_ids, o.logprobs or [], top_logprobs)
            if top_logprobs is not None else None,
            "finish_reason": parser.finish_reason(o.finish_reason)}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    return _chunk(rid, created, model, "chat.completion.chunk", with_usage,
                  {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    return _chunk(rid, created, model, "text_completion", with_usage,
                  {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})


def _chunk(rid: str, created: int, model: str, obj: str, with_usage: bool, choice: dict[str, Any]) -> dict[str, Any]:
    """One choice's stream chunk; with include_usage every chunk carries ``usage: null`` until the last."""
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int,
                completion_tokens: int, prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the totals."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, prediction)}
