"""``EngineClient``: the one door to the engine. ``LLM``, ``AsyncLLM``, the CLI, the server and every facade
submit, abort, read stats and model info through it and use nothing else of the engine.

It owns the tokenizer and the input and output processors, and talks to the engine core through one of two
transports with the same methods: the engine loop's thread in this process (``EngineLoop``), or a core in its own
process (``CoreProcess``: CUDA's default; ``EMBER_ENGINE_CORE_PROCESS`` chooses, ``use_core_process``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ember.config import EngineConfig, ResolvedConfig
from ember.core.loop import EngineLoop
from ember.executor import serve_launched
from ember.frontend.adapters import Adapters
from ember.frontend.core_process import CoreProcess, use_core_process
from ember.frontend.media import MediaPolicy
from ember.frontend.multimodal import ImageInputs, image_parts
from ember.frontend.output_processor import OutputProcessor, OutputSink, RequestState
from ember.frontend.output_stream import OutputStream
from ember.frontend.parallel_sampling import fan_out
from ember.frontend.processor import InputProcessor, PromptType
from ember.frontend.structured_output import Grammars
from ember.lora.request import LoRARequest
from ember.model_loader import load_tokenizer, read_shape
from ember.model_loader.pooler import folder_pooler, with_model_defaults
from ember.openmp import release_pool
from ember.protocol import ModelInfo, PoolingParams
from ember.sampling_params import OutputKind, SamplingParams
from ember.tokenizer import Message, Tokenizer


def _serves_rank_0(resolved: ResolvedConfig) -> bool:
    return resolved.parallel.backend == "launched" and resolved.parallel.rank != 0


def start_client(config: EngineConfig) -> EngineClient:
    """The client of config's engine, as every entry point builds it. On a rank other than 0 of a launched group
    (torchrun, mpirun, srun run the user's script on every rank) there is none: the rank serves rank 0's engine until
    rank 0 shuts it down, then ends the process, as TensorRT-LLM's MPI workers do."""
    resolved = config.resolve()
    if _serves_rank_0(resolved):
        serve_launched(resolved)  # does not return
    return EngineClient(config)


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        resolved = config.resolve()
        if _serves_rank_0(resolved):
            raise ValueError(f"EngineClient: rank {resolved.parallel.rank} of a launched group has no engine of its "
                             "own; start_client(config) serves rank 0's engine there")
        folder = folder_pooler(resolved.model.path)  # a sentence-transformers folder's pooling, checked first
        tok = load_tokenizer(resolved.model)
        self.tokenizer: Tokenizer = tok.tokenizer
        self.generation_config = tok.generation_config
        self._outputs = OutputProcessor(self.tokenizer)
        grammars = Grammars(self.tokenizer, tok.eos_token_ids)  # structured output: the front end compiles,
        if use_core_process(resolved):  # the core process builds its own matchers from the grammar text
            self._loop: EngineLoop | CoreProcess = CoreProcess(config, resolved, self._outputs)
        else:
            self._loop = EngineLoop(config, resolved, self._outputs, grammars)  # the core takes matchers from it
        self.model_info: ModelInfo = self._loop.model_info
        defaults = SamplingParams.from_generation_config(tok.generation_config)
        self.adapters = Adapters(self.model_info, lambda: read_shape(resolved.model.path))
        self.pooler = with_model_defaults(folder, self.model_info.encoder_only)  # the folder's, else vLLM's
        images = None
        if self.model_info.image_token_id is not None:
            policy = MediaPolicy(allowed_local_media_path=config.allowed_local_media_path,
                                 allowed_media_domains=tuple(config.allowed_media_domains)
                                 if config.allowed_media_domains is not None else None)
            info = self.model_info
            images = ImageInputs(resolved.model.path, info.image_token_id, config.images_per_prompt, policy,
                                 info.hidden_size, info.image_tokens, info.image_pixels, info.image_grid)
            try:
                images.check_model()  # a processor that does not match the model fails the load, not each request
            except BaseException:
                self._loop.shutdown()
                raise
        self.images: ImageInputs | None = images  # a vision-language model's image handling; None: text only
        self._inputs = InputProcessor(self.tokenizer, self.model_info, tok.eos_token_ids, defaults, grammars,
                                      self.adapters, self.pooler, images)
        self.eos_token_ids: tuple[int, ...] = tok.eos_token_ids  # the model's EOS ids, filled into requests

    def default_params(self) -> SamplingParams:
        """The model's generation defaults (generation_config.json), as vLLM reads them."""
        return self._inputs.default_params.clone()

    def chat_prompt(self, conversation: list[Message], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int] | dict[str, Any]:
        """Token ids of a conversation rendered with the model's chat template; with image parts (OpenAI's
        ``image_url``, or ``image`` / ``image_pil`` holding a PIL image), a prompt dict of those ids and the images,
        which the input processor places where the template wrote the image tokens."""
        conversation, images = image_parts(conversation, self.images, self.model_info.model)
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)
        # the template already holds any BOS token; encode without adding special tokens again
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids

    def prompt_token_ids(self, prompt: list[int] | dict[str, Any]) -> list[int]:
        """The token ids the model reads for what ``chat_prompt`` returned: each image's tokens expanded."""
        if not isinstance(prompt, dict):
            return prompt
        images = prompt.get("multi_modal_data", {}).get("image")
        ids = prompt["prompt_token_ids"]
        return self.images.place(ids, images, "messages")[0] if images and self.images is not None else ids

    def submit(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams | PoolingParams | None],
               sink: OutputSink, request_ids: Sequence[str | None] | None = None,
               loras: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Validate every request (raising before any is queued), then queue them together; their outputs go to
        sink as RequestOutput deltas (an exception if the engine stops). Returns the request ids. loras: the
        adapter of each request (None: the base model). A request with PoolingParams is an embedding: prefilled
        only, in the same steps as the others, answered by one EmbeddingRequestOutput."""
        request_ids = request_ids or [None] * len(prompts)
        loras = loras or [None] * len(prompts)
        states, records = [], []
        for prompt, sp, rid, lora in zip(prompts, params, request_ids, loras):
            text, record = self._inputs.process(prompt, sp, rid, lora)
            core = fan_out(record)  # n > 1: one core request a sample
            states.append(RequestState(record.request_id, text, record.prompt_token_ids, record.params, sink,
                                       [c.request_id for c in core], record.pooling is not None,
                                       record.prediction_token_ids))
            records.extend(core)
        self._outputs.register(states)
        if isinstance(self._loop, EngineLoop):  # the core steps on a thread of this process: see ember.openmp
            release_pool()
        try:
            self._loop.add(records)
        except BaseException:
            self._outputs.forget([s.request_id for s in states])
            raise
        return [s.request_id for s in states]

    def stream(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
               kind: OutputKind | None = None, asynchronous: bool = False,
               lora: LoRARequest | None = None) -> OutputStream:
        """Submit one request and return its stream: iterate it (``async for`` when asynchronous) for its
        outputs in ``kind`` (default: the request's output_kind)."""
        loop = asyncio.get_running_loop() if asynchronous else None
        if kind is None:
            kind = (params if isinstance(params, SamplingParams) else self._inputs.default_params).output_kind
        stream = OutputStream(loop, kind)
        stream.request_id = self.submit([prompt], [params], stream.put, [request_id], [lora])[0]
        stream.on_close = self.abort
        return stream

    def abort(self, request_id: str) -> None:
        """End the request (its samples finish with finish_reason "abort"); unknown ids are ignored."""
        for core_id in self._outputs.core_ids(str(request_id)):
            self._loop.abort(core_id)

    def add_lora(self, lora: LoRARequest) -> bool:
        """Check an adapter and load it now (into a free or idle slot) rather than at its first request."""
        lora = self.adapters.check(lora)
        try:
            self._loop.utility("add_lora", lora)
        except BaseException:
            self.adapters.remove(lora.lora_int_id)  # not loadable: not accepted either
            raise
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it); False if the id is unknown."""
        if not self.adapters.remove(lora_id):
            return False
        self._loop.utility("remove_lora", lora_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters accepted so far, by id."""
        return self.adapters.list()

    def stats(self) -> dict[str, Any]:
        """The engine's counters as one flat dict (``EngineStats.as_dict``)."""
        return self._loop.stats().as_dict()

    def is_alive(self) -> bool:
        """The engine loop is running (a health check: False once it stopped or failed)."""
        return self._loop.is_alive()

    def stop_reason(self) -> str | None:
        """Why the engine loop stopped (the error it recorded); None while it runs."""
        if self._loop.is_alive():
            return None
        return str(self._loop.dead or "the engine loop is not running")

    def rank_reports(self, reset: bool = False) -> list[dict[str, Any]]:
        """Every rank's place, its weight and KV bytes and its seconds in collectives since the last reset (rank 0
        first; one entry for a single-rank engine)."""
        return self._loop.utility("rank_reports", reset)

    def shutdown(self) -> None:
        """Stop the engine loop and join its thread; requests still open end with EngineDeadError."""
        self._loop.shutdown()
