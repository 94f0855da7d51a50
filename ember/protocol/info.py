"""What a client may know about the loaded engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    scheduling_policy: str
    kv_cache_dtype: str
    quantization: str | None  # the weight layout, described; None: float weights
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    executor: str = "uni"  # how the ranks run (EngineConfig.distributed_executor_backend, resolved)
    attention_window: int | None = None  # StreamingLLM: KV tokens a sequence keeps (sinks included); None: all
    sink_tokens: int = 0
    max_loras: int = 0  # adapters resident at once (0: LoRA off)
    max_lora_rank: int = 0
    kv_block_bytes: int = 0  # one block of the KV pool on rank 0 (its stage's layers, its KV heads)
    hidden_size: int = 0  # the width of a pooled vector (the largest ``dimensions`` an embedding may ask)
    encoder_only: bool = False  # an encoder (BERT): it serves embeddings only
    image_token_id: int | None = None  # a vision-language model's image placeholder token; None: text only
    image_tokens: int | None = None  # tokens an image takes when the tower fixes it (LLaVA); None: the image decides
    image_pixels: tuple[int, int] | None = None  # (height, width) the tower takes when fixed
    image_grid: bool = False  # its token positions follow each image's grid (Qwen2-VL's M-RoPE)
