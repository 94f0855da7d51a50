"""The KV pool, the host tier and the prefix cache: ``CacheConfig``, and the memory sizes users write."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ember.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "uint4")  # how the paged pool stores K and V (ember.layers.kv_cache)


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
