"""EasyDeL's ``vSurge`` on ember: one native engine (an ``EngineClient``) built from the model handle and vSurge's
arguments; ``generate`` translates prompts and EasyDeL's SamplingParams, submits them together and gathers the
deltas into ReturnSamples.

Life cycle: ``from_model`` checks every setting; ``compile()`` builds the engine (loads the weights, sizes the KV
pool, and warms up at the configured sizes: max_concurrent_decodes sequences at max_length, a max_prefill_length
prefill); ``start()`` builds it if compile was skipped and opens ``generate``; ``stop()`` shuts the engine down
(requests still open end with an error). ``generate`` before ``start`` or after ``stop`` raises at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from ember.compat.easydel.modeling import EasyDeLCausalLM
from ember.compat.easydel.outputs import PromptProgress, ReturnSample
from ember.compat.easydel.sampling import SamplingParams
from ember.config import EngineConfig
from ember.frontend.client import EngineClient, start_client
from ember.frontend.inbox import Inbox
from ember.sampling_params import SamplingParams as NativeParams


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _State(enum.Enum):
    CREATED = "created"  # settings checked, no engine yet
    COMPILED = "compiled"  # engine built and warmed up
    RUNNING = "running"  # generate accepted
    STOPPED = "stopped"


class vSurge:  # noqa: N801  (EasyDeL's name)
    def __init__(self, model: EasyDeLCausalLM, processor: Any, engine_config: EngineConfig, vsurge_name: str,
                 extra_eos_token_ids: tuple[int, ...] = (), bytecode_decode: bool = False,
                 prefill_lengths: tuple[int, ...] = ()) -> None:
        self.model, self._processor, self.engine_config = model, processor, engine_config
        self._vsurge_name = vsurge_name
        self.extra_eos_token_ids = extra_eos_token_ids
        self._bytecode_decode = bytecode_decode  # ember's detokenizer holds back incomplete UTF-8 either way
        self.prefill_lengths = prefill_lengths  # EasyDeL's compiled prompt buckets; ember's shapes are dynamic
        self.client: EngineClient | None = None
        self._state = _State.CREATED

    @classmethod
    def from_model(cls, model: EasyDeLCausalLM, processor: Any = None, max_concurrent_decodes: int | None = None,
                   max_concurrent_prefill: int | None = None, extra_eos_token_ids: int | list[int] | None = None,
                   prefill_lengths: int | list[int] | None = None, max_prefill_length: int | None = None,
                   max_length: int | None = None, interleaved_mode: bool = False, slot_clear_steps: int = 0,
                   vsurge_name: str | None = None, verbose: bool = True, bytecode_decode: bool = False,
                   seed: int = 894, num_pages: int | None = None, tokens_per_page: int | None = None,
                   **kwargs: Any) -> "vSurge":
        """Check the settings and return a vSurge (the engine is built by ``compile`` / ``start``).

        max_concurrent_decodes: sequences running at once (ember's max_num_seqs; default 64, where EasyDeL takes
        jax's device count). max_concurrent_prefill: prompts prefilled in one step (default 1, as EasyDeL).
        max_prefill_length: the prefill tokens of one step, so the longest prefill chunk (default max_length // 2,
        as EasyDeL; a longer prompt is prefilled in chunks). max_length: prompt + output tokens of a sequence
        (default the model's mask_max_position_embeddings). tokens_per_page / num_pages: ember's KV block size and
        the KV pool's most blocks. interleaved_mode, slot_clear_steps, verbose: accepted (ember always mixes prefill
        chunks with decodes in a step, frees a sequence's KV blocks when it ends, and logs through the "ember"
        logger).
        """
        if kwargs:
            raise TypeError(f"vSurge.from_model() got arguments ember does not know: {', '.join(sorted(kwargs))}")
        if not isinstance(model, EasyDeLCausalLM):
            raise ValueError(f"model={type(model).__name__} is not supported: pass what "
                             "AutoEasyDeLModelForCausalLM.from_pretrained returned")
        max_length = max_length or model.max_length
        positions = int(getattr(model.config, "max_position_embeddings", 0) or max_length)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= positions:
            raise ValueError(f"max_length={max_length!r} is out of range: it must be an integer in [2, {positions}] "
                             "(the model's max_position_embeddings)")
        max_prefill_length = max_prefill_length or max_length // 2
        if isinstance(prefill_lengths, int) and not isinstance(prefill_lengths, bool):
            max_prefill_length, buckets = prefill_lengths, (prefill_lengths,)
        elif isinstance(prefill_lengths, (list, tuple)):
            if not prefill_lengths or not all(isinstance(i, int) and i > 0 for i in prefill_lengths):
                raise ValueError("`prefill_lengths` must be a list of integers if provided as a list.")
            if max(prefill_lengths) != max_prefill_length:
                raise ValueError("The maximum value in `prefill_lengths` list must match `max_prefill_length`.")
            buckets = tuple(prefill_lengths)
        elif prefill_lengths is None:
            buckets = ()
        else:
            raise TypeError("`prefill_lengths` must be an int, list of ints, or None.")
        extra = (extra_eos_token_ids,) if isinstance(extra_eos_token_ids, int) else tuple(extra_eos_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in extra):
            raise ValueError(f"extra_eos_token_ids={extra_eos_token_ids!r} is out of range: token ids >= 0")
        optional = {}  # left out: EngineConfig's defaults
        if max_concurrent_decodes is not None:
            optional["max_num_seqs"] = max_concurrent_decodes
        if tokens_per_page is not None:
            optional["block_size"] = tokens_per_page
        config = EngineConfig(**{**model.engine_settings, "max_model_len": max_length},
                              max_num_prefill_seqs=max_concurrent_prefill or 1,
                              max_num_batched_tokens=max_prefill_length, seed=seed, **optional)
        if num_pages is not None:
            if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
                raise ValueError(f"num_pages={num_pages!r} is out of range: it must be an integer >= 1")
            config = dataclasses.replace(config, max_kv_cache_tokens=num_pages * config.block_size)
        name = vsurge_name or f"{model.model_type}-{model.num_parameters / 1e9:.2f}b"
        return cls(model, processor, config, name, extra, bytecode_decode, buckets)

    @classmethod
    def create_odriver(cls, model: EasyDeLCausalLM, processor: Any = None, storage: Any = None, manager: Any = None,
                       page_size: int = 128, hbm_utilization: float = 0.6, max_concurrent_prefill: int | None = None,
                       max_concurrent_decodes: int | None = None, prefill_lengths: int | list[int] | None = None,
                       max_prefill_length: int | None = None, max_length: int | None = None, seed: int = 894,
                       vsurge_name: str | None = None, verbose: bool = True) -> "vSurge":
        """EasyDeL's oDriver surge (paged attention: pages of page_size tokens, hbm_utilization of the device's
        memory for them), on ember's engine, whose KV cache is always paged: page_size is the block size;
        hbm_utilization is the memory fraction on CUDA (of the device, as EasyDeL's) and, on CPU, where there is
        no HBM, ember's own default holds. storage / manager (EasyDeL's page cache and manager) must be None:
        ember builds its own pool."""
        for name, value in (("storage", storage), ("manager", manager)):
            if value is not None:
                raise ValueError(f"{name}={type(value).__name__} is not supported: ember builds its own paged KV pool "
                                 "(size it with page_size and hbm_utilization); pass None")
        if isinstance(hbm_utilization, bool) or not isinstance(hbm_utilization, (int, float)) \
                or not 0 < hbm_utilization <= 1:
            raise ValueError(f"hbm_utilization={hbm_utilization!r} is out of range: it must be a number in (0, 1]")
        surge = cls.from_model(model, processor, max_concurrent_decodes=max_concurrent_decodes,
                               max_concurrent_prefill=max_concurrent_prefill, prefill_lengths=prefill_lengths,
                               max_prefill_length=max_prefill_length, max_length=max_length, seed=seed,
                               vsurge_name=vsurge_name, verbose=verbose, tokens_per_page=page_size)
        if surge.engine_config.device.startswith("cuda") or (surge.engine_config.device == "auto"
                                                             and _cuda_available()):
            surge.engine_config = dataclasses.replace(surge.engine_config,
                                                      kv_cache_memory_fraction=float(hbm_utilization))
        return surge

    @classmethod
    def create_vdriver(cls, model: EasyDeLCausalLM, processor: Any = None, max_concurrent_decodes: int | None = None,
                       prefill_lengths: int | list[int] | None = None, max_prefill_length: int | None = None,
                       max_length: int | None = None, vsurge_name: str | None = None, verbose: bool = True,
                       seed: int = 894) -> "vSurge":
        """EasyDeL's vDriver surge (what from_model builds): the same engine."""
        return cls.from_model(model, processor, max_concurrent_decodes=max_concurrent_decodes,
                              prefill_lengths=prefill_lengths, max_prefill_length=max_prefill_length,
                              max_length=max_length, vsurge_name=vsurge_name, verbose=verbose, seed=seed)

    # ----- life cycle -----

    @property
    def vsurge_name(self) -> str:
        return self._vsurge_name

    @property
    def bytecode_decode(self) -> bool:
        return self._bytecode_decode

    @property
    def processor(self) -> Any:
        """The processor given to from_model, else the model's own tokenizer."""
        if self._processor is not None:
            return self._processor
        return self._engine("processor").tokenizer

    def compile(self) -> None:
        """Build the engine: load the weights, size the KV pool and warm up at the configured sizes (once)."""
        if self._state is _State.STOPPED:
            self._state = _State.CREATED  # compile after stop builds a fresh engine
        if self.client is None:
            self.client = start_client(self.engine_config)
            self._state = _State.COMPILED

    def start(self) -> None:
        """Open generate (building the engine first when compile was not called)."""
        self.compile()
        self._state = _State.RUNNING

    def stop(self) -> None:
        """Shut the engine down; requests still open end with an error. start() builds a new engine."""
        if self.client is not None:
            self.client.shutdown()
        self.client = None
        self._state = _State.STOPPED

    def _engine(self, what: str) -> EngineClient:
        if self._state is _State.RUNNING and self.client is not None:
            return self.client
        if self._state is _State.STOPPED:
            raise RuntimeError(f"vSurge {self.vsurge_name!r} was stopped: call start() again before {what}")
        raise RuntimeError(f"vSurge {self.vsurge_name!r} is not started: call start() before {what}")

    # ----- tokens -----

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._processor is None:
            return self._engine("tokenizing").tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(self._processor(text=text, add_special_tokens=add_special_tokens)["input_ids"])

    def count_tokens(self, text_or_conversation: str | list) -> int:
        """Tokens of a string, or of a conversation rendered with the chat template (no generation prompt)."""
        if isinstance(text_or_conversation, str):
            return len(self._encode(text_or_conversation))
        if isinstance(text_or_conversation, list):
            if self._processor is not None and hasattr(self._processor, "apply_chat_template"):
                ids = self._processor.apply_chat_template(conversation=text_or_conversation, tokenize=True,
                                                          add_generation_prompt=False)
                return len(ids if isinstance(ids, list) else ids.get("input_ids", []))
            client = self._engine("count_tokens")
            return len(client.prompt_token_ids(client.chat_prompt(text_or_conversation, add_generation_prompt=False)))
        raise ValueError(f"Unsupported input type for token counting: {type(text_or_conversation)}")

    # ----- generation -----

    def generate(self, prompts: str | Sequence[str], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, stream: bool = False, bytecode_decode: bool | None = None) -> "Generation":
        """``await`` it for one ReturnSample per prompt (stream=False), or iterate it with ``async for`` (also after
        ``await``, as EasyDeL's coroutine returns the iterator) for lists of ReturnSample, one per prompt, each the
        cumulative state; the last list carries the final state (``finished``, ``finish_reason``)."""
        client = self._engine("generate()")
        prompts, params = _pair(prompts, sampling_params)
        requests = [self._request(client, p, sp) for p, sp in zip(prompts, params)]
        return Generation(client, requests, [sp.detokenize for sp in params], stream)

    def _request(self, client: EngineClient, prompt: str, sp: SamplingParams) -> tuple[list[int], NativeParams]:
        ids = self._encode(prompt)
        if sp.truncate_prompt_tokens is not None:
            ids = ids[-sp.truncate_prompt_tokens:]
        eos = (*client.eos_token_ids, *self.extra_eos_token_ids) if self.extra_eos_token_ids else ()
        return ids, sp.native(self._bad_words(sp.bad_words or []), eos)

    def _bad_words(self, words: list[str]) -> list[list[int]] | None:
        """Token sequences of each word as written and after a space (a word inside a sentence), as vLLM does."""
        seqs = {tuple(self._encode(v, add_special_tokens=False)) for w in words for v in (w, " " + w)}
        return [list(s) for s in sorted(seqs) if s] or None

    def __repr__(self) -> str:
        return f"vSurge(name={self.vsurge_name!r}, state={self._state.value}, model={self.model.path!r})"


def _pair(prompts: Any, sampling_params: Any) -> tuple[list[str], list[SamplingParams]]:
    """EasyDeL's rules: one prompt takes one SamplingParams (or None); a list takes one, one per prompt, or None."""
    if isinstance(prompts, str):
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError("If prompts is str, sampling_params must be SamplingParams or None.")
        return [prompts], [sampling_params or SamplingParams()]
    if not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a string or a sequence of strings.")
    if sampling_params is None:
        params = [SamplingParams()] * len(prompts)
    elif isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, Sequence) and all(isinstance(s, SamplingParams) for s in sampling_params):
        if len(prompts) != len(sampling_params):
            raise ValueError("Lengths of prompts and sampling_params lists must match.")
        params = list(sampling_params)
    else:
        raise ValueError("sampling_params must be SamplingParams, list of SamplingParams, or None.")
    return list(prompts), params


class Generation(Coroutine):
    """One generate() call: a coroutine (awaited, or given to asyncio.run, as EasyDeL's ``async def generate`` is)
    whose result is the final ReturnSamples, or with stream=True the async iterator itself; with stream=True it is
    also async iterable at once. Its requests are submitted together when it is first awaited or iterated, and
    aborted if the consumer leaves or is cancelled before they end."""

    def __init__(self, client: EngineClient, requests: list[tuple[list[int], NativeParams]],
                 detokenize: list[bool], stream: bool) -> None:
        self.client, self.requests, self.detokenize, self.stream = client, requests, detokenize, stream
        self._used = False
        self._coro: Coroutine | None = None

    def _coroutine(self) -> Coroutine:
        if self._coro is None:
            self._coro = self._result()
        return self._coro

    def __await__(self):
        return self._coroutine().__await__()

    def send(self, value: Any) -> Any:
        return self._coroutine().send(value)

    def throw(self, *exc: Any) -> Any:
        return self._coroutine().throw(*exc)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    async def _result(self) -> "list[ReturnSample] | AsyncIterator[list[ReturnSample]]":
        if self.stream:
            return self.__aiter__()
        last: list[ReturnSample] = []
        updates = self._run(final_only=True)
        try:
            async for last in updates:
                pass
        finally:  # cancelled: abort the requests now
            await updates.aclose()
        return last

    def __aiter__(self) -> AsyncIterator[list[ReturnSample]]:
        if not self.stream:
            raise TypeError("generate(stream=False) is awaited, not iterated: `await surge.generate(...)`")
        return self._run()

    async def _run(self, final_only: bool = False) -> AsyncIterator[list[ReturnSample]]:
        """A snapshot per batch of deltas (final_only: one, at the end; the snapshots' copies are skipped)."""
        if self._used:
            raise RuntimeError("a generate() result is consumed once: call generate() again")
        self._used = True
        if not self.requests:
            return
        inbox = Inbox(asyncio.get_running_loop())
        start = time.perf_counter()
        ids = self.client.submit([r[0] for r in self.requests], [r[1] for r in self.requests], inbox.put)
        index = {rid: i for i, rid in enumerate(ids)}
        progress = [PromptProgress(r[1].n, start, d) for r, d in zip(self.requests, self.detokenize)]
        open_ids = set(ids)
        try:
            while open_ids:
                items = await inbox.take()  # every delta that arrived meanwhile goes into one snapshot
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    progress[index[item.request_id]].add(item)
                    if item.finished:
                        open_ids.discard(item.request_id)
                if not final_only or not open_ids:
                    yield [p.sample() for p in progress]
        finally:
            for rid in open_ids:
                self.client.abort(rid)

