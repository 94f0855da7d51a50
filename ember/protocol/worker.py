"""What a worker reports to the engine core as data: the loaded model's facts and the KV pool start-up planned.
The core builds its block manager and ``ModelInfo`` from these and never holds a worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Rank 0's model as loaded."""

    architecture: str
    dtype: str  # torch's name without the prefix: "float32", "bfloat16"
    device: str
    vocab_size: int
    quantization: str | None  # the weight layout, described; None: float weights
    kv_bytes_per_block: int  # one block of this rank's KV pool (its stage's layers, its KV heads)
    # a draft model's decode step against the model's at batch 1, timed at start-up; None: no draft model
    draft_cost: float | None = None
    # the prompt tokens a step may feed a new sequence's draft KV for about one decode step's time (its catch-up,
    # spread over steps), timed at start-up; None: no draft model
    draft_catch_up: int | None = None
    # a step verifying k drafted tokens against a decode step at batch 1, k = 0 .. the longest draft, timed at
    # start-up (worker.verify_cost); None: not measured (no speculative_config, several ranks, CUDA)
    verify_costs: tuple[float, ...] | None = None
    hidden_size: int = 0  # the width of a pooled vector
    encoder_only: bool = False  # an encoder (BERT): bidirectional, no KV kept, pooling requests only
    image_token_id: int | None = None  # a vision-language model's image placeholder token; None: text only
    # what its vision tower takes when that is fixed (LLaVA): tokens an image, (height, width) of pixel_values
    image_tokens: int | None = None
    image_pixels: tuple[int, int] | None = None
    image_grid: bool = False  # its token positions follow each image's grid (Qwen2-VL's M-RoPE)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What start-up decided and measured; the engine core sizes its block manager from it."""

    num_blocks: int
    num_host_blocks: int
    block_size: int
    activation_bytes: int
    budget_source: str
    warmup_peak_bytes: int
