"""``ember.AsyncLLM``: asyncio front of the engine. Many generators share one event loop; each request's outputs
arrive on its own stream. Leaving an ``async for`` early aborts the request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ember.config import EngineConfig
from ember.frontend.client import start_client
from ember.frontend.processor import PromptType
from ember.lora.request import LoRARequest
from ember.outputs import EmbeddingRequestOutput, RequestOutput
from ember.protocol import ModelInfo, PoolingParams
from ember.sampling_params import OutputKind, SamplingParams


class AsyncLLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.client = start_client(self.config)

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.client.model_info

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs in the request's output_kind: cumulative snapshots (default), deltas, or the final one only."""
        outputs = self.client.stream(prompt, sampling_params, request_id, asynchronous=True,
                                     lora=lora_request).__aiter__()
        try:
            async for out in outputs:
                yield out
        finally:  # a consumer that leaves early aborts the request now, not when the stream is collected
            await outputs.aclose()

    async def embed(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                    request_id: str | None = None) -> EmbeddingRequestOutput:
        """One prompt's embedding (``LLM.embed``'s rules), computed in the engine's steps next to any generation;
        a caller cancelled while it waits aborts the request."""
        outputs = self.client.stream(prompt, pooling_params or PoolingParams(), request_id, kind=OutputKind.DELTA,
                                     asynchronous=True).__aiter__()
        try:
            async for out in outputs:
                return out
        finally:
            await outputs.aclose()
        raise RuntimeError("the embedding's stream ended without an output")

    async def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.client.add_lora(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return self.client.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.client.list_loras()}

    def stats(self) -> dict[str, Any]:
        return self.client.stats()

    def shutdown(self) -> None:
        """Stop the engine loop and join its thread; unfinished requests end with an error."""
        self.client.shutdown()
