"""``EngineConfig``: everything that shapes the engine, as the user gave it, checked before any work starts; and
``ResolvedConfig``, the frozen parts each layer reads, derived from it once."""

from __future__ import annotations

import os
import warnings
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING

from ember import envs
from ember.config import hub
from ember.config.cache import KV_CACHE_DTYPES, CacheConfig, is_ratio, parse_bytes
from ember.config.checks import boolean, check, integer, number, one_of
from ember.config.model import (
    INT4_GROUP_SIZES,
    QUANT_ALGORITHMS,
    QUANT_METHODS,
    QUANT_MODES,
    LoRAConfig,
    ModelConfig,
    canonical_dtype,
    cuda_available,
    is_torch_dtype,
    model_path,
)
from ember.config.parallel import EXECUTOR_BACKENDS, ParallelConfig
from ember.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from ember.config.speculative import SpeculativeConfig
from ember.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine, as the user gave it. max_model_len / max_num_batched_tokens default from
    the model (``scheduler``)."""

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
    # int4 and int8 weights multiply activations quantized to int8 per row and block of 32 inputs (as llama.cpp's
    # Q8_0 blocks, with a float32 scale), exact integer products: on CPUs with AVX512-BF16, VNNI and VBMI where AMX
    # does not run the weights (Zen 4 / 5), W1 about 1.3x (kernels 1.1-2.8x), batch invariant; the log-probabilities
    # further from float32's (SmolLM2: 0.077 against 0.051 mean change; llama.cpp 0.060), so greedy answers part
    # from float32's sooner: off by default (docs/int8_activations.md); ignored elsewhere
    int8_activations: bool = False
    # weights: None = as the checkpoint stores them (a quantized .asmodel stays quantized; GGUF Q8_0/Q4_0/Q4_1/Q4_K
    # blocks stay int8/int4 unless dtype is float32); "none" = float; "int8" | "int4" | "w8a8" = quantize at load;
    # "awq" (int4 after AWQ's activation-aware scales) | "smoothquant" (w8a8 after smoothing) = calibrate on text
    # first, once: the transformed float weights are cached (docs/quantization.md)
    quantization: str | None = None
    quant_group_size: int | None = None  # int4 groups: 32, 64 or 128; None: 128 (GGUF Q4 blocks: their 32)
    quantize_embeddings: bool | None = None  # the embedding table and LM head as int8; None: as the checkpoint has it
    calibration_data: str | None = None  # awq / smoothquant: a UTF-8 text file to calibrate on; None: the shipped text
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "int8" or "uint4"
    tensor_parallel_size: int = 1  # ranks each layer is split over (heads, MLP columns, vocabulary)
    pipeline_parallel_size: int = 1  # stages the layers are split into
    # StreamingLLM: each sequence keeps the KV of its first sink_tokens tokens and of the most recent ones,
    # attention_window tokens in all, and attends to those only, so generation goes on past the window with
    # constant KV memory (docs/decoding.md); None: full attention
    attention_window: int | None = None
    sink_tokens: int = 0
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
    # speculative decoding (vLLM's name and keys): a dict such as {"method": "ngram", "num_speculative_tokens": 4}
    # or a SpeculativeConfig; None: one token a step (docs/speculative.md)
    speculative_config: dict | SpeculativeConfig | None = None
    # vision-language models (vLLM's names): images a prompt may hold ({"image": n}; None: 8), and where images may
    # come from besides the request itself: files under one folder, URLs of these hosts (None: neither)
    limit_mm_per_prompt: dict | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | tuple[str, ...] | None = None
    # TensorRT-LLM's names of attention_window and sink_tokens, still taken (with a DeprecationWarning); the
    # TensorRT-LLM facade translates its own configs
    max_attention_window_size: InitVar[int | None] = None
    sink_token_length: InitVar[int | None] = None

    def __post_init__(self, max_attention_window_size: int | None, sink_token_length: int | None) -> None:
        for old, new, value in (("max_attention_window_size", "attention_window", max_attention_window_size),
                                ("sink_token_length", "sink_tokens", sink_token_length)):
            if value is not None:
                warnings.warn(f"{old} is TensorRT-LLM's name; ember's is {new}", DeprecationWarning, stacklevel=3)
                object.__setattr__(self, new, value)
        check(self, RULES)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.speculative_config is not None and self.attention_window is not None:
            raise ConfigError("speculative_config is not supported with attention_window (StreamingLLM): a rejected "
                              "draft's KV would overwrite a slot the window still attends to; leave one of them None")
        if getattr(self.speculative_config, "method", None) == "draft_model" and self.pipeline_parallel_size > 1:
            raise ConfigError("speculative_config method='draft_model' runs whole on every tensor-parallel rank, "
                              "not split in stages: pipeline_parallel_size must be 1 (method='ngram' works split)")
        self._check_media()
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"model={self.model!r} is not a path: pass a Hugging Face folder, a .gguf file, an "
                              ".asmodel file or None (the default model)")
        if not isinstance(self.device, str) or not (self.device == "auto" or self.device.startswith("cpu")
                                                    or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r} is not supported: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.device.startswith("cuda") and not cuda_available():
            raise ConfigError(f"device={self.device!r} but no CUDA device is available: use device='cpu'")
        if not is_torch_dtype(self.dtype) and not (self.dtype == "auto" or (
                isinstance(self.dtype, str) and canonical_dtype(self.dtype))):
            raise ConfigError(f"dtype={self.dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or "
                              "'float16'")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) <= 0:
            raise ConfigError(f"kv_cache_memory={self.kv_cache_memory!r} is out of range: it must be > 0 bytes")
        c = self.cpu_cache_memory
        if c is not None and (c <= 0 if is_ratio(c) else parse_bytes(c, "cpu_cache_memory") <= 0):
            raise ConfigError(f"cpu_cache_memory={c!r} is out of range: use bytes > 0, a size like '4GiB', or a "
                              "fraction of available RAM in (0, 1]")
        if self.quantization is not None and self.quantization not in ("none", *QUANT_MODES):
            raise ConfigError(f"quantization={self.quantization!r} is not supported: use None (as stored), 'none', "
                              f"{', '.join(repr(m) for m in QUANT_METHODS)}, or a calibrated algorithm: "
                              f"{', '.join(repr(a) for a in QUANT_ALGORITHMS)}")
        _check_calibration_data(self.calibration_data, self.quantization)
        w, sink = self.attention_window, self.sink_tokens
        if w is not None and w <= sink:
            raise ConfigError(f"attention_window={w!r} is out of range: it must be an integer > sink_tokens "
                              f"({sink}), the KV tokens a sequence keeps, sink tokens included")
        if w is None and sink:
            raise ConfigError(f"sink_tokens={sink} needs attention_window: sink tokens are kept when a window drops "
                              "the others")

    def resolve(self) -> ResolvedConfig:
        """The frozen parts each layer reads; the model path and the device are found here (errors raised)."""
        return ResolvedConfig(self._model(), self._cache(), self._parallel(), self.speculative_config)

    def scheduler(self, max_position: int) -> SchedulerConfig:
        """The step and sequence limits, settled against the model's length limit (read from its checkpoint)."""
        if self.max_model_len is not None and self.max_model_len > max_position:
            raise ConfigError(f"max_model_len={self.max_model_len} is out of range: this model supports at most "
                              f"{max_position} positions")
        max_model_len = self.max_model_len or max_position
        default_budget = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        budget = self.max_num_batched_tokens or default_budget
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ConfigError(f"max_num_batched_tokens={budget} is out of range: without chunked prefill it must be "
                              f">= max_model_len ({max_model_len}) so any prompt fits a step")
        return SchedulerConfig(self.max_num_seqs, max_model_len, budget, self.enable_chunked_prefill,
                               self.scheduling_policy, self.max_num_prefill_seqs)

    def _model(self) -> ModelConfig:
        device = self.device if self.device != "auto" else ("cuda" if cuda_available() else "cpu")
        tokenizer = (hub.resolve(str(self.tokenizer), arg="tokenizer", files=hub.TOKENIZER_FILES,
                                 accepted="a tokenizer folder") if self.tokenizer is not None else None)
        calibration = (os.path.abspath(os.path.expanduser(str(self.calibration_data))) if self.calibration_data
                       else None)
        lora = LoRAConfig(self.max_loras, self.max_lora_rank) if self.enable_lora else None
        spec = self.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":  # the engine's dtype, device and threads
            draft = ModelConfig(model_path(spec.model), None, self.dtype, device, spec.quantization, None, None,
                                self.seed, self.num_threads, None, None, self.enforce_eager, self.batch_invariant,
                                int8_activations=self.int8_activations)
        return ModelConfig(model_path(self.model), tokenizer, self.dtype, device, self.quantization,
                           self.quant_group_size, self.quantize_embeddings, self.seed, self.num_threads, calibration,
                           lora, self.enforce_eager, self.batch_invariant, draft,
                           spec.num_speculative_tokens if spec is not None else 0, self.int8_activations)

    def _cache(self) -> CacheConfig:
        fraction, source = self.kv_cache_memory_fraction, "kv_cache_memory_fraction"
        if fraction is None:
            fraction, source = envs.mem_ratio(), envs.MEM_RATIO
            if fraction is None:
                source = "default"
        given = self.kv_cache_memory
        return CacheConfig(self.block_size, self.kv_cache_dtype, parse_bytes(given) if given is not None else None,
                           fraction, source, repr(given) if given is not None else None, self.cpu_cache_memory,
                           self.enable_prefix_caching and self.attention_window is None,
                           self.prefix_cache_ttl, self.attention_window, self.sink_tokens,
                           self.max_kv_cache_tokens)

    def _parallel(self) -> ParallelConfig:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        world, backend = tp * pp, self.distributed_executor_backend
        launched = envs.launcher_rank()
        if backend is None:
            backend = "uni" if world == 1 else "launched" if launched and launched[1] == world else "mp"
        if backend == "uni" and world > 1:
            raise ConfigError(f"distributed_executor_backend='uni' runs one rank in process, but tensor_parallel_size "
                              f"x pipeline_parallel_size = {world}: use 'mp', 'launched' or 'ray'")
        if backend != "launched":
            return ParallelConfig(tp, pp, backend)
        if launched is None or launched[1] != world:
            found = "no launcher's RANK / WORLD_SIZE" if launched is None else f"WORLD_SIZE={launched[1]}"
            raise ConfigError(f"distributed_executor_backend='launched' needs every rank started by a launcher with "
                              f"WORLD_SIZE = tensor_parallel_size x pipeline_parallel_size = {world}; found {found} "
                              "(see docs/parallel.md)")
        if envs.master_address() is None:
            raise ConfigError("distributed_executor_backend='launched' needs MASTER_ADDR and MASTER_PORT (the address "
                              "where rank 0 listens); torchrun sets them, mpirun and srun scripts must export them")
        return ParallelConfig(tp, pp, backend, launched[0], launched[2])


    def _check_media(self) -> None:
        limit = self.limit_mm_per_prompt
        if limit is not None and (not isinstance(limit, dict) or set(limit) - {"image"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limit.values())):
            raise ConfigError(f"limit_mm_per_prompt={limit!r} is not supported: pass a dict like {{'image': 4}} "
                              "(an integer >= 0) or None")
        path = self.allowed_local_media_path
        if path is not None and not (isinstance(path, (str, os.PathLike)) and os.path.isdir(path)):
            raise ConfigError(f"allowed_local_media_path={path!r} is not a folder: pass an existing folder or None")
        domains = self.allowed_media_domains
        if domains is not None and (isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains)):
            raise ConfigError(f"allowed_media_domains={domains!r} is not supported: pass a list of host names or "
                              "None")

    @property
    def images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)


DEFAULT_IMAGES_PER_PROMPT = 8

# each field's range, checked first (``checks.check``); the checks above relate fields or read files
RULES = {
    "max_num_seqs": integer(1), "block_size": integer(1), "max_model_len": integer(2, optional=True),
    "max_num_batched_tokens": integer(1, optional=True), "max_num_prefill_seqs": integer(1, optional=True),
    "tensor_parallel_size": integer(1), "pipeline_parallel_size": integer(1), "max_loras": integer(1),
    "max_lora_rank": integer(1), "max_kv_cache_tokens": integer(1, optional=True),
    "kv_cache_memory_fraction": number(0, 1, low_open=True, optional=True),
    "prefix_cache_ttl": number(0, optional=True, what="a number of seconds"),
    "scheduling_policy": one_of(SCHEDULING_POLICIES), "quant_group_size": one_of(INT4_GROUP_SIZES, optional=True),
    "kv_cache_dtype": one_of(KV_CACHE_DTYPES), "num_threads": integer(1, optional=True), "seed": integer(),
    "sink_tokens": integer(0), "attention_window": integer(1, optional=True),
    "enable_lora": boolean(), "enforce_eager": boolean(), "batch_invariant": boolean(), "int8_activations": boolean(),
    "enable_prefix_caching": boolean(), "enable_chunked_prefill": boolean(),
    "distributed_executor_backend": one_of(EXECUTOR_BACKENDS, optional=True),
}


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None = None


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


