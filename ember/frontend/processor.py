"""Prompt in, ``EngineRequest`` out: tokenize, fill in the model's defaults and check everything against the
engine's limits, in the caller's thread, so a bad request is refused with a ``BadRequestError`` that names the
field, the value and the allowed range before anything is queued."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from ember.core.block_manager import blocks_for, request_blocks
from ember.protocol import KVWindow
from ember.errors import BadRequestError, DoesNotFitError
from ember.frontend.adapters import Adapters
from ember.frontend.multimodal import ImageInputs
from ember.frontend.structured_output import Grammars
from ember.lora.request import LoRARequest
from ember.model_loader.pooler import PoolerDefaults
from ember.protocol import POOLING_TYPES, EngineRequest, ModelInfo, PoolingParams
from ember.sampling_params import SamplingParams
from ember.tokenizer import Tokenizer

PromptType = str | Seq[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt, text-only
# ember's addition to a prompt dict: OpenAI's predicted output, as text or token ids (docs/speculative.md)
_PREDICTION_KEYS = ("prediction", "prediction_token_ids")
# vLLM's: {"image": an image or a list of them} or {"image_embeds": the encoder's output for each}
_MM_KEY, _MM_KINDS = "multi_modal_data", ("image", "image_embeds")
MAX_PREDICTION_TOKENS = 32768  # a prediction longer than this is refused (it is indexed in the engine core)


def _is_token_ids(x: Any) -> bool:
    """A sequence of ints (bools excluded), not a string."""
    return isinstance(x, Seq) and not isinstance(x, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def encoder_refusal(info: ModelInfo) -> BadRequestError:
    """What a generation request on an encoder is answered."""
    return BadRequestError(f"model {info.model} ({info.architecture}) is an encoder: it serves embeddings only "
                           "(LLM.embed, /v1/embeddings), not text generation")


def prompt_list(prompts: Any) -> list[PromptType]:
    """One prompt or a list of them as a list: a string, a list of token ids (one prompt), a vLLM-style dict
    ({"prompt": text} or {"prompt_token_ids": ids}), or a list of those."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if prompts is None or not hasattr(prompts, "__iter__"):
        raise BadRequestError(f"prompts={prompts!r} is not supported: pass a string, a list of token ids, or a list "
                              "of those")
    prompts = list(prompts)
    if prompts and _is_token_ids(prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise BadRequestError("prompts=[] is empty: pass at least one prompt")
    return prompts


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, info: ModelInfo, eos_token_ids: tuple[int, ...],
                 default_params: SamplingParams, grammars: Grammars | None = None,
                 adapters: Adapters | None = None, pooler: PoolerDefaults | None = None,
                 images: ImageInputs | None = None) -> None:
        """images: a vision-language model's image handling (None: the model takes text only)."""
        self.tokenizer = tokenizer
        self.images = images
        self.pooler = pooler or PoolerDefaults("cls" if info.encoder_only else "last", True)
        self.grammars = grammars
        self.adapters = adapters
        self.info = info
        self.eos_token_ids = eos_token_ids
        self.default_params = default_params
        self.window = KVWindow(info.attention_window, info.sink_tokens) if info.attention_window else None
        self._counter = itertools.count()

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            return self._tokenize_dict(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequestError("prompt='' is empty: a prompt needs at least one character or token")
            return prompt, self.tokenizer.encode(prompt)
        if _is_token_ids(prompt):
            return None, list(prompt)
        raise BadRequestError(f"prompt of type {type(prompt).__name__} is not supported: pass a string, a list "
                              "of token ids, or a dict with 'prompt' or 'prompt_token_ids'")

    def _tokenize_dict(self, prompt: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        """vLLM's TextPrompt / TokensPrompt: exactly one of the two keys; others (multi_modal_data...) refused."""
        other = [k for k in prompt if k not in _PROMPT_KEYS]
        if other:
            raise BadRequestError(f"prompt[{other[0]!r}] is not supported: a prompt dict holds "
                                  f"one of {list(_PROMPT_KEYS)}, and optionally 'multi_modal_data'")
        if len(prompt) != 1:
            raise BadRequestError(f"prompt dict with keys {list(prompt)} is not supported: give exactly one of "
                                  f"{list(_PROMPT_KEYS)}")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise BadRequestError(f"prompt['prompt'] of type {type(prompt['prompt']).__name__} is not supported: "
                                      "pass a string")
            return self.tokenize(prompt["prompt"])
        ids = prompt["prompt_token_ids"]
        if not _is_token_ids(ids):
            raise BadRequestError("prompt['prompt_token_ids'] is not supported: pass a list of token ids")
        return None, list(ids)

    def process(self, prompt: Any, params: SamplingParams | None, request_id: str | None = None,
                lora: LoRARequest | None = None) -> tuple[str | None, EngineRequest]:
        """(prompt text or None, the request record); raises BadRequestError / DoesNotFitError. PoolingParams make
        a pooling (embedding) request (``process_pooling``)."""
        if isinstance(params, PoolingParams):
            return self.process_pooling(prompt, params, request_id, lora)
        if self.info.encoder_only:
            raise encoder_refusal(self.info)
        if params is not None and not isinstance(params, SamplingParams):
            raise BadRequestError(f"sampling_params of type {type(params).__name__} is not supported: pass a "
                                  "SamplingParams or None")
        params = (params or self.default_params).clone()
        prompt, prediction = self._prediction(prompt)
        prompt, images = self._images(prompt)
        text, ids = self.tokenize(prompt)
        info, vocab = self.info, self.info.vocab_size
        self._check_ids(ids, "prompt", "a prompt")
        mm = ()
        if self.images is not None and (images or self.images.image_token_id in ids):
            kind = images[0] if images else "image"
            place = self.images.place_embeds if kind == "image_embeds" else self.images.place
            ids, mm = place(ids, images[1] if images else [], f"prompt[{_MM_KEY!r}][{kind!r}]")
        if len(ids) + max(1, params.min_tokens) > info.max_model_len:
            raise BadRequestError(f"prompt has {len(ids)} tokens: prompt length plus min_tokens (at least 1 new "
                                  f"token) must be <= max_model_len ({info.max_model_len})")
        if params.n > info.max_num_seqs:
            raise BadRequestError(f"n={params.n} is out of range: n must be <= max_num_seqs ({info.max_num_seqs})")
        if params.beam_width > info.max_num_seqs:
            raise BadRequestError(f"beam_width={params.beam_width} is out of range: every beam is a running sequence, "
                                  f"so beam_width must be <= max_num_seqs ({info.max_num_seqs})")
        max_num_tokens = min(len(ids) + (params.max_tokens or info.max_model_len), info.max_model_len)
        self._check_fits(len(ids), params, max_num_tokens)
        if not params.eos_token_ids:
            params.eos_token_ids = self.eos_token_ids
        if params.thinking_token_budget is not None and not params.thinking_tags:
            params.thinking_tags = tuple(tuple(self.tokenizer.encode(tag, add_special_tokens=False))
                                         for tag in ("<think>", "</think>"))
        for name, given in (("stop_token_ids", params.stop_token_ids), ("eos_token_ids", params.eos_token_ids),
                            ("stop_token_sequences", [t for s in params.stop_token_sequences for t in s]),
                            ("bad_words_ids", [t for s in params.bad_words_ids for t in s]),
                            ("thinking_tags", [t for s in params.thinking_tags for t in s])):
            bad = [t for t in given if t >= vocab]
            if bad:
                raise BadRequestError(f"{name} holds {bad[0]}, out of range: token ids must be in [0, {vocab})")
        rid = self._request_id(request_id)
        salt = None
        if lora is not None:
            if self.adapters is None:
                raise BadRequestError("lora_request is not supported by this engine client")
            lora = self.adapters.check(lora)
            salt = f"lora-{lora.lora_int_id}"  # an adapter's KV differs from the base model's for the same tokens
        grammar = None
        if params.structured_outputs is not None:  # compiled last: every cheaper check has passed
            if self.grammars is None:
                raise BadRequestError("structured_outputs is not supported by this engine client")
            grammar = self.grammars.compile(params.structured_outputs)
        return text, EngineRequest(rid, ids, params, max_num_tokens, salt, grammar, lora,
                                   prediction_token_ids=prediction, mm_inputs=mm)

    def _request_id(self, request_id: Any) -> str:
        if request_id is None:
            return str(next(self._counter))
        if isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
            return str(request_id)
        raise BadRequestError(f"request_id={request_id!r} is not supported: pass a string, an int or None")

    def pooling_params(self, params: PoolingParams) -> PoolingParams:
        """params with the model's defaults filled in, every field checked."""
        d, hidden = self.pooler, self.info.hidden_size
        pooling = d.pooling if params.pooling is None else params.pooling
        if pooling not in POOLING_TYPES:
            raise BadRequestError(f"pooling={pooling!r} is not supported: use one of {list(POOLING_TYPES)}")
        normalize = d.normalize if params.normalize is None else params.normalize
        if not isinstance(normalize, bool):
            raise BadRequestError(f"normalize={normalize!r} is not supported: pass true, false or null")
        dims = params.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= hidden):
            raise BadRequestError(f"dimensions={dims!r} is out of range: it must be an integer in [1, {hidden}] "
                                  "(the model's hidden size)")
        k = params.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise BadRequestError(f"truncate_prompt_tokens={k!r} is out of range: it must be >= 1, or -1 "
                                  f"(max_model_len, {self.info.max_model_len})")
        return PoolingParams(pooling, normalize, dims, self.info.max_model_len if k == -1 else k)

    def _check_ids(self, ids: list[int], field: str, one: str) -> None:
        """A tokenized prompt holds at least one token, each in the vocabulary (field: its name; one: "a prompt")."""
        if not ids:
            raise BadRequestError(f"{field} is empty: {one} needs at least one token")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"{field} token id {bad[0]} is out of range: token ids must be in [0, {vocab})")

    def process_pooling(self, prompt: Any, params: PoolingParams, request_id: str | None = None,
                        lora: LoRARequest | None = None) -> tuple[str | None, EngineRequest]:
        """A pooling request: prefilled only, its pooled hidden state returned when its last prompt token is
        computed. Raises BadRequestError / DoesNotFitError before anything is queued."""
        if lora is not None:
            raise BadRequestError("lora_request is not supported for embeddings: pass None")
        params = self.pooling_params(params)
        text, ids = self.tokenize(prompt)
        info = self.info
        self._check_ids(ids, "input", "an input")
        k = params.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            # an encoder's text keeps its first tokens and its closing special token, as sentence-transformers
            # truncates; token ids and decoders keep their last k tokens, as vLLM does
            ids = ids[:k - 1] + ids[-1:] if info.encoder_only and text is not None and k > 1 else ids[-k:]
        if len(ids) > info.max_model_len:
            raise BadRequestError(f"input has {len(ids)} tokens: it must be <= max_model_len ({info.max_model_len})"
                                  "; or pass truncate_prompt_tokens")
        if blocks_for(len(ids), info.block_size) > info.num_kv_blocks:
            raise DoesNotFitError(f"input has {len(ids)} tokens: it can never fit the KV pool of "
                                  f"{info.num_kv_blocks * info.block_size} tokens")
        return text, EngineRequest(self._request_id(request_id), ids, SamplingParams(max_tokens=1), len(ids),
                                   pooling=params)

    def _images(self, prompt: Any) -> tuple[Any, tuple[str, list[Any]] | None]:
        """The prompt without its ``multi_modal_data``, and its kind ("image" or "image_embeds") with the images
        loaded and checked."""
        if not isinstance(prompt, Mapping) or _MM_KEY not in prompt:
            return prompt, None
        rest = {k: v for k, v in prompt.items() if k != _MM_KEY}
        data = prompt[_MM_KEY]
        if self.images is None:
            raise BadRequestError(f"prompt[{_MM_KEY!r}] is not supported: model {self.info.model} "
                                  f"({self.info.architecture}) takes text only")
        if not isinstance(data, Mapping) or not data:
            raise BadRequestError(f"prompt[{_MM_KEY!r}] is not supported: pass a dict like {{'image': image}}")
        other = [k for k in data if k not in _MM_KINDS]
        if other:
            raise BadRequestError(f"prompt[{_MM_KEY!r}][{other[0]!r}] is not supported: use one of {list(_MM_KINDS)}")
        if len(data) > 1:
            raise BadRequestError(f"prompt[{_MM_KEY!r}] has both {list(_MM_KINDS)}: give images or their embeddings")
        if "image_embeds" in data:
            return rest, ("image_embeds", self.images.embeds_of(data["image_embeds"],
                                                                f"prompt[{_MM_KEY!r}]['image_embeds']"))
        return rest, ("image", self.images.images_of(data["image"], f"prompt[{_MM_KEY!r}]['image']"))

    def _prediction(self, prompt: Any) -> tuple[Any, list[int] | None]:
        """The prompt without its prediction, and the prediction's token ids (None: no prediction)."""
        if not isinstance(prompt, Mapping) or not any(k in prompt for k in _PREDICTION_KEYS):
            return prompt, None
        rest = {k: v for k, v in prompt.items() if k not in _PREDICTION_KEYS}
        given = [k for k in _PREDICTION_KEYS if k in prompt]
        if self.window is not None:
            raise BadRequestError(f"prompt[{given[0]!r}] is not supported with attention_window (StreamingLLM): "
                                  "speculative decoding would overwrite KV slots the window still attends to")
        if len(given) > 1:
            raise BadRequestError(f"prompt has both {given}: give the prediction as text or as token ids, not both")
        value = prompt[given[0]]
        if given[0] == "prediction":
            if not isinstance(value, str):
                raise BadRequestError(f"prompt['prediction'] of type {type(value).__name__} is not supported: pass "
                                      "the predicted text as a string")
            ids = self.tokenizer.encode(value, add_special_tokens=False)
        elif _is_token_ids(value):
            ids = list(value)
        else:
            raise BadRequestError("prompt['prediction_token_ids'] is not supported: pass a list of token ids")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"prediction token id {bad[0]} is out of range: token ids must be in [0, {vocab})")
        if len(ids) > MAX_PREDICTION_TOKENS:
            raise BadRequestError(f"prediction has {len(ids)} tokens: at most {MAX_PREDICTION_TOKENS} are taken")
        return rest, ids or None

    def _check_fits(self, prompt_len: int, params: SamplingParams, max_num_tokens: int) -> None:
        """Refuse a request the KV pool can never hold (under guaranteed_no_evict: never reserve for)."""
        info = self.info
        blocks, bs = info.num_kv_blocks, info.block_size
        pool = blocks * bs
        window = self.window
        if window is not None and params.use_beam_search:
            raise BadRequestError(f"beam_width={params.beam_width} is not supported with attention_window "
                                  "(StreamingLLM): beams share blocks that the window's ring would overwrite")
        least = prompt_len + max(1, params.min_tokens)
        if window is not None:
            least = window.kept(least)
        if blocks_for(least, bs) > blocks:
            raise DoesNotFitError(f"prompt has {prompt_len} tokens: prompt plus min_tokens ({least} tokens) can "
                                  f"never fit the KV pool of {pool} tokens; it must be <= {pool}")
        if params.use_beam_search:  # the beams advance together, so all of them must fit at once (+1 block each
            # for the partial block copied on write)
            w = params.beam_width
            need = request_blocks(prompt_len, max_num_tokens, w, bs) + w
            if need > blocks:
                raise DoesNotFitError(f"beam_width={w} with max_tokens={params.max_tokens} needs {need} KV blocks "
                                      f"({w} beams of up to {max_num_tokens} tokens sharing the prompt), more than "
                                      f"the pool's {blocks}: lower beam_width or max_tokens, or give the KV cache "
                                      "more memory")
        elif info.scheduling_policy == "guaranteed_no_evict":
            need = request_blocks(prompt_len, max_num_tokens, params.n, bs, window)
            if need > blocks:
                raise DoesNotFitError(f"max_tokens={params.max_tokens} with n={params.n} needs {need} KV blocks under "
                                      f"scheduling_policy='guaranteed_no_evict', more than the pool's {blocks}: "
                                      "lower max_tokens or n, or use 'max_utilization'")

