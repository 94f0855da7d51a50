"""The memory budget: how big the KV pool (and the host tier) may be, and how much a step's activations take.

The pool is what is left of a memory fraction after the weights and the peak activation memory of one step, which
is measured, not guessed: a dummy forward at the per-step token budget runs under ``PeakMemory``. On CUDA the
fraction is of the device's memory (vLLM's ``gpu_memory_utilization``: what is already in use counts against it);
on CPU it is of the RAM available after loading. An explicit byte size replaces the fraction.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass

import torch

from ember import envs
from ember.config import CacheConfig, available_memory_bytes, is_ratio, parse_bytes

logger = logging.getLogger("ember")

DEFAULT_CUDA_RATIO = 0.9
DEFAULT_CPU_RATIO = 0.1
DEFAULT_CPU_CAP = 4 << 30  # the CPU default (no fraction given) stays modest: other processes share the RAM


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_now(device: torch.device) -> tuple[int, int]:
    """(in use, peak since the last reset) in bytes: CUDA allocator stats, or this process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    return _rss_bytes("VmRSS"), _rss_bytes("VmHWM")


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so that what a measured block reuses shows up in RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


class PeakMemory:
    """Bytes a block of code needed above what was in use when it started (its transient peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes = 0
        self.start = 0  # in use when the block started
        self.peak = 0  # absolute: in use before + transient

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            release_free_memory()
        reset_peak(self.device)
        self.start = memory_now(self.device)[0]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.peak = memory_now(self.device)[1]
        self.bytes = max(0, self.peak - self.start)


@dataclass(slots=True)
class PoolBudget:
    bytes: int
    source: str  # how it was decided, for messages


def kv_pool_budget(cache: CacheConfig, device: torch.device, activation_bytes: int) -> PoolBudget:
    """Bytes the KV pool may take once the weights and a step's activations are accounted for."""
    if cache.kv_cache_memory is not None:
        return PoolBudget(cache.kv_cache_memory, f"kv_cache_memory={cache.kv_cache_memory_text}")
    ratio, source = cache.memory_fraction, cache.memory_fraction_source
    act = f"{activation_bytes / 2**20:.0f} MiB of peak activations"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        ratio = DEFAULT_CUDA_RATIO if ratio is None else ratio
        used = total - free
        budget = int(ratio * total) - used - activation_bytes
        return PoolBudget(budget, f"{source}={ratio} of {total / 2**30:.1f} GiB device memory, less "
                                  f"{used / 2**20:.0f} MiB in use (weights) and {act}")
    avail = available_memory_bytes()
    if ratio is None:
        budget = min(int(DEFAULT_CPU_RATIO * avail), DEFAULT_CPU_CAP) - activation_bytes
        return PoolBudget(budget, f"the default {DEFAULT_CPU_RATIO} of {avail / 2**30:.1f} GiB available RAM "
                                  f"(at most {DEFAULT_CPU_CAP >> 30} GiB), less {act}")
    return PoolBudget(int(ratio * avail) - activation_bytes,
                      f"{source}={ratio} of {avail / 2**30:.1f} GiB available RAM, less {act}")


def host_tier_bytes(cache: CacheConfig, device: torch.device) -> int:
    """Bytes of the host tier: only on CUDA (on a CPU engine the KV already lives in host memory), and only with
    prefix caching (the tier holds evicted prefix blocks: the core uses none without it)."""
    value = cache.cpu_cache_memory
    if value is None:
        return 0
    if not cache.enable_prefix_caching:
        logger.info("host KV tier is off: prefix caching is off (cpu_cache_memory=%r ignored)", value)
        return 0
    if device.type != "cuda" and not envs.host_tier_on_cpu():
        logger.info("host KV tier is off on a CPU engine: the KV cache already lives in host memory "
                    "(cpu_cache_memory=%r ignored)", value)
        return 0
    if is_ratio(value):
        return int(value * available_memory_bytes())
    return parse_bytes(value, "cpu_cache_memory")


def fit_hint(pool_tokens: int, max_model_len: int, max_num_seqs: int) -> str:
    """The largest max_model_len and max_num_seqs this pool holds, for error messages."""
    hint = (f"the largest that fit: max_model_len={pool_tokens} (one sequence at a time), or "
            f"max_model_len={pool_tokens // max_num_seqs} to hold all max_num_seqs={max_num_seqs} at full length")
    if pool_tokens >= max_model_len:
        hint += f", or max_num_seqs={pool_tokens // max_model_len} at max_model_len={max_model_len}"
    return hint
