"""OpenAI request bodies -> ember prompts and ``SamplingParams``.

Defaults come from the model's ``generation_config.json`` (as vLLM reads it); a field the client sets wins. Range
checks are ``SamplingParams``' own, so the HTTP API refuses exactly what the Python API refuses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ember.errors import BadRequestError
from ember.frontend.client import EngineClient
from ember.frontend.processor import encoder_refusal
from ember.sampling_params import OutputKind, SamplingParams, StructuredOutputsParams
from ember.server import reasoning, tools
from ember.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling
from ember.server.reply import ReplyFormat

# body field -> SamplingParams field, copied when the client sets them
_COPIED = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens", "stop")

_BEAM_OFF = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}


def _params(req: _Sampling, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    changes = {name: getattr(req, name) for name in _COPIED if getattr(req, name) is not None}
    if changes.get("top_k") == -1:  # OpenAI-style clients write -1 for "off"
        changes["top_k"] = 0
    changes.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                   output_kind=OutputKind.DELTA, structured_outputs=_structured(req))
    if req.use_beam_search:  # the model's default draws (top_p, ...) have no beam meaning; the client's are refused
        changes.update({k: off for k, off in _BEAM_OFF.items() if getattr(req, k) is None},
                       beam_width=req.n, length_penalty=req.length_penalty)
    return defaults.clone(**changes)


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def _structured(req: _Sampling) -> StructuredOutputsParams | None:
    """The one structured-output constraint a body sets, from whichever field it uses."""
    given: dict[str, StructuredOutputsParams] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise BadRequestError("response_format.json_schema.schema is required with type 'json_schema'")
        given["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
    for name, kind in _GUIDED:
        if getattr(req, name) is not None:
            given[name] = StructuredOutputsParams(**{kind: getattr(req, name)})
    if req.structured_outputs is not None:
        given["structured_outputs"] = SamplingParams(structured_outputs=req.structured_outputs).structured_outputs
    if len(given) > 1:
        raise BadRequestError(f"{' and '.join(given)} are both set: a request takes at most one structured-output "
                              "constraint")
    return next(iter(given.values()), None)


def chat_request(client: EngineClient, req: ChatCompletionRequest, tool_parser: str | None = None,
                 thinks: bool = False) -> tuple[list[int] | dict, SamplingParams, ReplyFormat]:
    """The conversation rendered by the model's chat template with the request's tools (with its prediction, a
    prompt dict), the request's sampling parameters, and how its replies are read. tool_parser: the model's tool
    call format (None: it has none); thinks: the server splits ``<think>`` text out of this model's replies."""
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequestError(f"top_logprobs={req.top_logprobs} needs logprobs=true")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, name)
    params = _params(req, client.default_params(), max_tokens,
                     (req.top_logprobs or 0) if req.logprobs else None)
    if req.thinking_token_budget is not None:
        params = params.clone(thinking_token_budget=req.thinking_token_budget)
    plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser,
                      lambda marker: _single_token(client, marker), _answer_schema(req, params))
    # a call is the whole reply (a response format has no text to shape), or with auto the grammar holds both
    if plan.constraint is not None:
        if params.structured_outputs is not None and req.response_format is None:
            raise BadRequestError(f"tool_choice={tools.shown(req.tool_choice)} and a structured-output field are "
                                  "both set: a request takes at most one constraint")
        params = params.clone(structured_outputs=plan.constraint)
    if plan.parser is not None and req.skip_special_tokens:
        # call markers are often special tokens (Qwen's <tool_call>, Mistral's [TOOL_CALLS]): the parser must see them
        params = params.clone(skip_special_tokens=False)
    prompt = chat_prompt(client, req.messages, template_tools=plan.template_tools,
                         template_kwargs=req.chat_template_kwargs)
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt  # images: placed when submitted
    _check_length(client, name, max_tokens, len(ids))
    # a constrained reply (a required call, a format) is the answer from its first token: no thinking to split
    if params.structured_outputs is not None and params.thinking_token_budget is not None:
        raise BadRequestError(f"thinking_token_budget={params.thinking_token_budget} with a constrained reply "
                              "(tool_choice required or named, a response format): the reply has no thinking to "
                              "limit")
    thinks = thinks and params.structured_outputs is None
    thinking = thinks and reasoning.opens_thinking(client.tokenizer.decode(ids[-4:]))
    reply = ReplyFormat(plan.parser, thinks, thinking, tuple(t.function.name for t in req.tools or ()),
                        req.parallel_tool_calls is False)
    if req.prediction is not None:
        return {**(prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}),
                "prediction": req.prediction.text()}, params, reply
    return prompt, params, reply


async def off_loop(images: bool, work: Callable[[], Any]) -> Any:
    """A request's preparation, run on a worker thread when it has images: fetching an image URL (up to the fetch
    timeout), decoding and preprocessing would otherwise stall every other request and stream."""
    return await asyncio.to_thread(work) if images else work()


async def prepared_chat_request(client: EngineClient, req: ChatCompletionRequest, tool_parser: str | None = None,
                                thinks: bool = False) -> tuple[list[int] | dict, SamplingParams, ReplyFormat]:
    """``chat_request``, off the event loop when the conversation has images, which are preprocessed there too
    (cached by the client), so that submitting the prompt only places them."""
    def prepare() -> tuple[list[int] | dict, SamplingParams, ReplyFormat]:
        prompt, params, reply = chat_request(client, req, tool_parser, thinks)
        client.prompt_token_ids(prompt)
        return prompt, params, reply

    return await off_loop(any(m.has_images() for m in req.messages), prepare)


def _answer_schema(req: ChatCompletionRequest, params: SamplingParams) -> dict | None:
    """The JSON schema of the request's response_format (None: none, or not a JSON one)."""
    spec = params.structured_outputs
    if req.response_format is None or spec is None:
        return None
    if spec.json_object:
        return {"type": "object"}
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise BadRequestError(f"response_format.json_schema.schema is not valid JSON: {schema[:80]!r}") from None
    return schema if isinstance(schema, dict) else None


def _single_token(client: EngineClient, text: str) -> int | None:
    ids = client.tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _check_length(client: EngineClient, name: str, max_tokens: int | None, prompt_tokens: int | None) -> None:
    """OpenAI and vLLM refuse a max_tokens the context cannot hold, rather than cutting it short silently
    (prompt_tokens None: not known yet, so only max_tokens < max_model_len is checked)."""
    max_len = client.model_info.max_model_len
    if max_tokens is None or max_tokens <= max_len - (prompt_tokens or 1):
        return
    if prompt_tokens is None:
        raise BadRequestError(f"{name}={max_tokens} is out of range: it must be < max_model_len ({max_len})")
    raise BadRequestError(f"{name}={max_tokens} is out of range: the prompt's {prompt_tokens} tokens plus {name} "
                          f"must be <= max_model_len ({max_len})")


# template variables a client may not set: the request's own fields and the renderer's options
_RESERVED = frozenset({"tools", "messages", "add_generation_prompt", "tokenize", "chat_template", "documents",
                       "continue_final_message", "template", "special_tokens", "self", "conversation"})


def chat_prompt(client: EngineClient, messages: list[ChatMessage], add_generation_prompt: bool = True,
                template_tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int] | dict:
    if client.model_info.encoder_only:
        raise encoder_refusal(client.model_info)
    if not client.tokenizer.has_chat_template:
        raise BadRequestError("messages cannot be rendered: the model has no chat template (use /v1/completions)")
    reserved = sorted(k for k in template_kwargs or () if k in _RESERVED or k.endswith("_token")
                      or k.startswith("return_"))
    if reserved:
        raise BadRequestError(f"chat_template_kwargs sets {', '.join(reserved)}: these are the request's own fields, "
                              "the tokenizer's tokens or the renderer's options")
    kwargs = {**(template_kwargs or {}), **({"tools": template_tools} if template_tools is not None else {})}
    try:
        return client.chat_prompt(tools.template_messages(messages), add_generation_prompt=add_generation_prompt,
                                  **kwargs)
    except BadRequestError:
        raise
    except Exception as e:  # the template's own complaint (jinja raise_exception: roles out of order, ...)
        raise BadRequestError(f"messages cannot be rendered by the model's chat template: {e}") from None


def completion_request(client: EngineClient, req: CompletionRequest) -> tuple[list[str | list[int]], SamplingParams]:
    """The prompts (one or several) and their shared sampling parameters."""
    prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
        else [req.prompt]
    if not prompts:
        raise BadRequestError("prompt=[] is empty: pass a string, a list of token ids, or a list of those")
    logprobs = req.logprobs
    _check_length(client, "max_tokens", req.max_tokens, None)  # the engine client tokenizes the prompts later
    params = _params(req, client.default_params(), req.max_tokens, logprobs,
                     logprobs if req.echo and logprobs is not None else None)
    return prompts, params
