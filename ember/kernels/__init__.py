"""Native CPU kernels, compiled on first use with torch's C++ extension builder and cached.

Only what eager torch does badly lives here: paged decode and prefill attention that read the block pool in place,
the int4 / int8 weight-only GEMM (torch's packed ops cost the same per row at any batch), a fixed-order float32 /
bf16 dense GEMM for the float weights of batch-invariant layers on AVX-512 CPUs (oneDNN's rows depend on the batch
there), w8a8's per-token quantization and rescale fused around torch's int8 GEMM, and one-pass RoPE, K/V write,
SiLU-and-mul and residual add + RMSNorm (eager torch spends several small ops on each, every layer).
The AVX512-BF16 kernels compile only where the build machine has the instructions (``has_avx512_bf16()``).
Every kernel has a torch fallback: no compiler, a CUDA device or EMBER_CPU_KERNELS=0 select it, so the kernels
are an optimisation, never a requirement. A build that fails is logged as a warning naming what was lost, the
first lines of the reason and the file with the full output; only build and load errors fall back, a bug in
ember's own code propagates. Every kernel checks its arguments at entry (``checks.h``: device, dtype, rank, sizes
agreeing, contiguity where it reads in place, block tables, slots and lengths inside the pool) and raises a
RuntimeError naming the kernel, the argument and the value before it reads memory.
``emulated_kernels()`` (and EMBER_EMULATE_AVX512=1 for the engine) builds the AVX512-BF16 kernels over scalar
stand-ins of the instructions (``avx512_emulation.h``), so that a machine without AVX-512 can test what they compute.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import threading
import traceback
from types import ModuleType
from typing import TYPE_CHECKING

from ember import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("ember")
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False
_emulated: ModuleType | None = None
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "rms_norm.cpp", "quant_gemm.cpp", "elementwise.cpp",
            "prefill_attention.cpp", "w8a8.cpp", "dense_gemm.cpp", "int6_gemm.cpp",
            "w4a8.cpp", "w8a8_blocks.cpp")
# part of the cache key only
_HEADERS = ("avx512_util.h", "avx512_emulation.h", "amx.h", "checks.h", "quant_blocks.h", "w4a8.h")
_READY = "ready"  # written once a build has loaded: holds the library's path
# reassociation lets the compiler vectorise the dot products; infinities and NaNs keep their meaning
# -fopenmp: at::parallel_for is a header template that only runs in parallel when compiled with OpenMP; the
# library it links (libgomp.so.1) resolves to the copy torch has already loaded, so there is one thread pool.
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
           "-fopenmp"]


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here (the reason is logged once, loudly). Only a
    failed build or load falls back (``KernelBuildError``); a bug in ember's own code propagates."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if not envs.cpu_kernels_enabled():
            _failed = True
            return None
        try:
            _module = _build(envs.emulate_avx512())
        except KernelBuildError as e:
            _failed = True
            logger.warning("%s", _lost_message(e))
    return _module


class KernelBuildError(RuntimeError):
    """The kernels cannot be built or loaded on this machine: no compiler or ninja, a compile or link failure, a
    library that does not load. ``log``: the file holding the full output."""

    def __init__(self, reason: str, log: str | None) -> None:
        super().__init__(reason)
        self.log = log


# what "cannot build here" raises: torch's builder turns a failed compiler / ninja run into RuntimeError (its
# output in the message), a missing compiler or an unwritable cache folder is an OSError, a library that does not
# load is an ImportError; anything else (NameError, TypeError, AttributeError in ember's code) is a bug and propagates
_BUILD_ERRORS = (RuntimeError, OSError, subprocess.CalledProcessError, ImportError)
_LOST = ("paged decode / prefill attention, the int4 / int8 / w8a8 GEMMs, the batch-invariant dense GEMM, RoPE, "
         "K/V writes, SiLU-and-mul and add + RMSNorm")


def _lost_message(e: KernelBuildError) -> str:
    """The warning for a failed build: what was lost, what it costs, why (first lines) and how to fix or silence."""
    lines = str(e).strip().splitlines() or [type(e.__cause__).__name__]
    # the first line (torch's: the failing compiler command, long) and the first compiler errors after it
    errors = [line for line in lines[1:] if "error" in line.lower()][:2] or lines[1:3]
    reason = "\n    ".join(line if len(line) <= 300 else line[:300] + " ..." for line in [lines[0], *errors])
    where = f"; full output in {e.log}" if e.log else ""
    return (f"ember CPU kernels UNAVAILABLE, running torch's fallbacks instead ({_LOST}): decode is about 3x "
            f"slower. Reason:\n    {reason}{where}\nFix: install a C++ compiler (g++) and ninja, then restart; or "
            "set EMBER_CPU_KERNELS=0 to choose the torch path and silence this warning.")


def emulated_kernels() -> ModuleType:
    """The kernels built with the AVX-512 instructions emulated (slow; for tests on machines without them)."""
    global _emulated
    with _lock:
        if _emulated is None:
            _emulated = _build(True)
    return _emulated


def kernels_for(device: "torch.device"):
    """The CPU kernels when tensors on this device can use them, else None (the torch path)."""
    return cpu_kernels() if device.type == "cpu" else None


def _build(emulate: bool = False) -> ModuleType:
    import torch

    from ember.cache import cache_dir

    here = os.path.dirname(__file__)
    sources = [os.path.join(here, s) for s in _SOURCES]
    cflags = [*_CFLAGS, "-DEMBER_EMULATE_AVX512"] if emulate else _CFLAGS
    digest = hashlib.sha1(" ".join([torch.__version__, *cflags]).encode())
    for path in [*sources, *(os.path.join(here, h) for h in _HEADERS)]:
        with open(path, "rb") as f:
            digest.update(f.read())
    name = f"ember_cpu_{digest.hexdigest()[:12]}"
    build = None
    try:
        build = cache_dir("kernels", name)
        built = _load_built(build, name)
        if built is not None:
            return built
        from torch.utils.cpp_extension import load

        os.makedirs(build, exist_ok=True)
        with _build_lock(build):
            logger.info("building ember CPU kernels in %s (once)", build)
            module = load(name=name, sources=sources, build_directory=build, verbose=False, extra_cflags=cflags,
                          extra_ldflags=["-fopenmp"])
            with open(os.path.join(build, _READY), "w") as f:
                f.write(module.__file__)
        return module
    except _BUILD_ERRORS as e:
        if isinstance(e, (NotImplementedError, RecursionError)) or (
                isinstance(e, ImportError) and (e.name or "").split(".")[0] == "ember"):
            raise  # a bug, or ember's own import (the built library is ember_cpu_<hash>, not ember)
        log = _write_log(os.path.join(build, "build-error.log"), e) if build else None
        raise KernelBuildError(f"{type(e).__name__}: {e}", log) from e


def _write_log(path: str, e: BaseException) -> str | None:
    """The full text of a failed build (torch puts the compiler's output in its exception) where the warning can
    point to it; None where the folder cannot be written either."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(e)))
        return path
    except OSError:
        return None


def _load_built(build: str, name: str) -> ModuleType | None:
    """The library a finished build left (named in its ready file): imported directly, 0.5 ms, where torch's
    ``load`` imports its builder (setuptools) and re-hashes the sources first, 0.2 s of every start-up. The folder's
    name is the hash of the sources, flags and torch version, so a library in it is built from exactly these."""
    import importlib.util

    try:
        with open(os.path.join(build, _READY)) as f:
            path = f.read().strip()
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not os.path.isfile(path):
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build: str):
    """One process at a time builds or loads the kernels of a build folder, under an flock that the kernel drops
    when its holder dies. torch's own lock is a file that only exists while a build runs: a process killed
    mid-build leaves it behind and every later ``load`` waits on it forever, so under our lock it can only be
    stale and is removed."""
    import fcntl

    with open(os.path.join(build, "ember.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build, "lock")
            if os.path.exists(stale):
                logger.warning("removing a stale kernel build lock %s (a build was killed)", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
