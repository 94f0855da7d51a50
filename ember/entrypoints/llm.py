"""``ember.LLM``: the offline API in vLLM's shape (generate, chat, stream) over the background engine."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from ember.config import EngineConfig
from ember.core.engine import Engine, PromptType
from ember.outputs import RequestOutput
from ember.sampling_params import OutputKind, SamplingParams
from ember.tokenizer import Message


class LLM:
    """Load a model and generate from it. ``model=None`` is the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_num_seqs: int = 64, max_model_len: int | None = None, kv_cache_memory: int | str | None = None,
                 seed: int = 0, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, seed=seed, **kwargs)
        self.engine = Engine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's name for the tokenizer."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_params.clone()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        results: queue.Queue = queue.Queue()
        requests = [self.engine.make_request(p, sp, results.put) for p, sp in zip(prompts, params)]
        self.engine.submit(requests)
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated, done = time.perf_counter(), 0, 0
        try:
            while done < len(requests):
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                generated += sum(len(o.token_ids) for o in item.outputs)
                if item.request_id in outputs:
                    outputs[item.request_id].merge(item)
                else:
                    outputs[item.request_id] = item
                if item.finished:
                    done += 1
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} out tok/s")
        except BaseException:
            for r in requests:
                self.engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        return [outputs[r.request_id] for r in requests]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c, add_generation_prompt, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_prompt(self, conversation: list[Message], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **kwargs)
        # the template already holds any BOS token; encode without adding special tokens again
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield deltas (new text and token ids) as they are generated; the last one has finished=True."""
        params = (sampling_params or self.get_default_sampling_params()).clone(output_kind=OutputKind.DELTA)
        results: queue.Queue = queue.Queue()
        request = self.engine.make_request(prompt, params, results.put)
        self.engine.submit([request])
        finished = False
        try:
            while not finished:
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts=[] is empty: pass at least one prompt")
    return prompts


def _as_params_list(params: Any, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts: pass one, or one per prompt")
    return params
