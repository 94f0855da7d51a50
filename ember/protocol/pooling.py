"""A pooling (embedding) request's parameters: how the prompt's hidden states become one vector. The front end
fills every field from the request and the model's defaults (``model_loader.pooler``), so the core and workers
read no defaults of their own."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")  # the last token's state (decoders), the mean of all, the first token's


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """``pooling``: one of ``POOLING_TYPES`` (None: the model's default); ``normalize``: L2-normalise the vector
    (None: the model's default); ``dimensions``: keep the first ``dimensions`` values before normalising
    (Matryoshka; None: all); ``truncate_prompt_tokens``: keep the prompt's last k tokens (None: refuse a prompt
    longer than max_model_len)."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
