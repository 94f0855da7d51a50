"""``ember.LLM``: the offline API in vLLM's shape (generate, chat, stream), a client of the ``EngineClient``."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from ember.config import EngineConfig
from ember.errors import BadRequestError
from ember.frontend.client import start_client
from ember.frontend.processor import PromptType, prompt_list
from ember.lora.request import LoRARequest
from ember.outputs import EmbeddingRequestOutput, RequestOutput
from ember.protocol import ModelInfo, PoolingParams
from ember.sampling_params import OutputKind, SamplingParams
from ember.tokenizer import Message


class LLM:
    """Load a model and generate from it. ``model=None`` is the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_num_seqs: int = 64, max_model_len: int | None = None, kv_cache_memory: int | str | None = None,
                 seed: int = 0, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, seed=seed, **kwargs)
        self.client = start_client(self.config)

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.client.model_info

    def get_tokenizer(self):
        """vLLM's name for the tokenizer."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.client.default_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. lora_request: one adapter for every
        prompt or one per prompt (None: the base model; needs ``enable_lora=True``)."""
        prompts = prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params", SamplingParams)
        loras = _per_prompt(lora_request, len(prompts), "lora_request", LoRARequest)
        results: queue.Queue = queue.Queue()
        ids = self.client.submit(prompts, params, results.put, loras=loras)
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0

        def take(item: RequestOutput) -> bool:
            nonlocal generated
            generated += sum(len(o.token_ids) for o in item.outputs)
            if item.request_id in outputs:
                outputs[item.request_id].merge(item)
            else:
                outputs[item.request_id] = item
            if item.finished:
                bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} out tok/s")
            return item.finished

        self._wait(ids, results, bar, take)
        return [outputs[rid] for rid in ids]

    def _wait(self, ids: list[str], results: queue.Queue, bar: Any, take: Callable[[Any], bool]) -> None:
        """Until every request of ids has finished: take(item) keeps an output and says whether its request ended;
        an error from the engine (or an interrupt) aborts them all."""
        done = 0
        try:
            while done < len(ids):
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                if take(item):
                    done += 1
                    bar.update(1)
        except BaseException:
            for rid in ids:
                self.client.abort(rid)
            raise
        finally:
            bar.close()

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = False, *,
              pooling: str | None = None, normalize: bool | None = None, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding a prompt, in input order (vLLM's ``LLM.embed``): the prompt's hidden states pooled
        (``pooling``: "last", "mean" or "cls"; None: the model's default, from its sentence-transformers files),
        truncated to ``dimensions`` and L2-normalised when ``normalize`` (None: the model's default). The requests
        share the engine's steps with any generation in flight. pooling_params: one for every prompt or one per
        prompt, in place of the keyword arguments."""
        prompts = prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(pooling, normalize, dimensions, truncate_prompt_tokens)
        elif (pooling, normalize, dimensions, truncate_prompt_tokens) != (None, None, None, None):
            raise BadRequestError("pass pooling_params or the keyword arguments (pooling, normalize, dimensions, "
                                  "truncate_prompt_tokens), not both")
        params = _per_prompt(pooling_params, len(prompts), "pooling_params", PoolingParams)
        results: queue.Queue = queue.Queue()
        ids = self.client.submit(prompts, params, results.put)
        outputs: dict[str, EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Embedding", unit="req", disable=not use_tqdm, dynamic_ncols=True)

        def take(item: EmbeddingRequestOutput) -> bool:  # one output a request, once it has ended
            outputs[item.request_id] = item
            return True

        self._wait(ids, results, bar, take)
        return [outputs[rid] for rid in ids]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise BadRequestError(f"messages={messages!r} is not supported: pass a conversation (a list of "
                                  "{'role', 'content'} dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.client.chat_prompt(c, add_generation_prompt, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield deltas (new text and token ids) as they are generated; the last one has finished=True. The request
        is submitted at the first ``next``; closing the iterator early aborts it."""
        yield from self.client.stream(prompt, sampling_params, kind=OutputKind.DELTA, lora=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and load it now rather than at its first request."""
        return self.client.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters accepted so far (vLLM's shape)."""
        return {r.lora_int_id for r in self.client.list_loras()}

    def stats(self) -> dict[str, Any]:
        return self.client.stats()

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _per_prompt(value: Any, n: int, name: str, kind: type) -> list[Any]:
    """One value for every prompt, or a list of one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise BadRequestError(f"{name} of type {type(value).__name__} is not supported: pass a {kind.__name__}, "
                              "a list of one per prompt, or None")
    value = list(value)
    if len(value) != n:
        raise BadRequestError(f"{name} has {len(value)} entries for {n} prompts: pass one, or one per prompt")
    return value
