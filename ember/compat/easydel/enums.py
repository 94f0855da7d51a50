"""EasyDeL's enums and configuration records, with EasyDeL's names and values (easydel/infra/etils.py,
easydel/layers/attention.py, eformer's PartitionAxis), so that scripts pass them to ember unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, TypedDict


class EasyDeLQuantizationMethods(str, Enum):
    """Weight (and KV cache) quantization: NONE keeps floats; NF4 (4-bit) runs as ember's int4, A8BIT as int8."""

    NONE = None
    NF4 = "nf4"
    A8BIT = "8bit"


class EasyDeLGradientCheckPointers(str, Enum):
    """Training-time activation recomputation; inference has no backward pass, so every member is accepted."""

    EVERYTHING_SAVEABLE = "everything_saveable"
    NOTHING_SAVEABLE = "nothing_saveable"
    CHECKPOINT_DOTS = "checkpoint_dots"
    CHECKPOINT_DOTS_WITH_NO_BATCH_DMIS = "checkpoint_dots_with_no_batch_dims"
    NONE = ""


class AttentionMechanisms(str, Enum):
    """EasyDeL's attention kernels. ember runs its own paged attention whichever is named (docs/easydel.md)."""

    AUTO = "auto"
    FLASH_ATTN2 = "flash_attn2"
    RING = "ring"
    VANILLA = "vanilla"
    SPLASH = "splash"
    CUDNN = "cudnn"
    BLOCKWISE = "blockwise"
    SDPA = "sdpa"
    CUDA_FLASH_ATTN2 = "cuda_flash_attn2"
    RAGGED_PAGE_ATTENTION = "ragged_page_attention"
    PAGED_ATTENTION = "page_attention"
    REGRESSIVE_DECODE = "autoregressive_decodeattn"


class EasyDeLPlatforms(str, Enum):
    """Kernel families of EasyDeL; ember's kernels are chosen by device."""

    JAX = "jax"
    TRITON = "triton"
    PALLAS = "pallas"


class EasyDeLBackends(str, Enum):
    """Where EasyDeL runs: CPU maps to ember's device="cpu", GPU to "cuda"; TPU and TT have no ember backend."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"
    TT = "tt"


AxisType = str | tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class PartitionAxis:
    """Which mesh axes each tensor dimension is split over (eformer's PartitionAxis). ember reads ``head_axis``:
    the mesh axes it names (and fsdp) become tensor-parallel ranks; see ``sharding.tensor_parallel_size``."""

    batch_axis: AxisType = ("fsdp", "dp")
    sequence_axis: AxisType = "sp"
    query_sequence_axis: AxisType = "sp"
    head_axis: AxisType = "tp"
    key_sequence_axis: AxisType = "sp"
    hidden_state_axis: AxisType = "tp"
    attention_dim_axis: AxisType = None
    bias_head_sequence_axis: AxisType = None
    bias_key_sequence_axis: AxisType = None
    generation_query_sequence_axis: AxisType = None
    generation_head_axis: AxisType = "tp"
    generation_key_sequence_axis: AxisType = "sp"
    generation_attention_dim_axis: AxisType = None


class EasyDeLBaseConfigDict(TypedDict, total=False):
    """The model-config overrides of ``from_pretrained(config_kwargs=...)`` (a dict, as in EasyDeL). The keys ember
    reads are below; ``config_keys.ACCEPTED`` lists the others it accepts and why they change nothing here."""

    freq_max_position_embeddings: int
    mask_max_position_embeddings: int
    kv_cache_quantization_method: Any
    kvdtype: Any
    attn_mechanism: Any
    decode_attn_mechanism: Any
    gradient_checkpointing: Any
    sharding_axis_dims: Any
    sharding_axis_names: Any
    partition_axis: PartitionAxis
    backend: Any
    platform: Any
