"""Keep other threads' OpenMP pools from slowing the engine's parallel regions.

torch's CPU parallelism on Linux is GNU OpenMP (libgomp), which gives every thread that starts a parallel region
a pool of worker threads of its own, kept after the region ends. While the pools of the process hold more threads
than it has CPUs, libgomp's workers stop spinning between regions and sleep (a few hundred spins instead of
~300,000), so every region of a decode step (hundreds of them, most a few microseconds of work) pays a wake-up. One
``x @ x`` in the caller's thread, or a second engine's idle loop, was enough: the default model's batch-1 decode
fell from ~160 to ~68 tok/s on a 2-vCPU AMD EPYC. ``release_pool`` frees the calling thread's pool (OpenMP 5.0's
``omp_pause_resource_all``; libgomp recreates it at that thread's next region, ~1 ms): a thread about to hand work
to an engine on another thread calls it, and so does an engine's loop idle for a second. Elsewhere (not Linux,
another OpenMP runtime, no libgomp loaded) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

_OMP_PAUSE_SOFT = 1
_pause: Any = None  # libgomp's omp_pause_resource_all once found; False: this libgomp has none


def release_pool() -> None:
    """Free the calling thread's OpenMP worker threads, if it has any (a no-op inside a parallel region)."""
    global _pause
    if _pause is None:
        _pause = _lookup()
    if _pause:
        _pause(_OMP_PAUSE_SOFT)


def _lookup() -> Any:
    """The loaded libgomp's omp_pause_resource_all (torch's own copy may be renamed, as in aarch64 wheels); None
    while torch is not imported (this never loads a library), False where there is none to call: no /proc (not
    Linux), no libgomp, one older than OpenMP 5.0, or LLVM's / Intel's runtime under its name (their pause stops
    every thread's pool)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {_mapped_path(line) for line in f if "/libgomp" in line}
    except OSError:
        return False
    for path in sorted(paths, key=_torch_first):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is None or hasattr(lib, "kmp_get_blocktime"):
            return False
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return False if "torch" in sys.modules else None  # torch loads its OpenMP runtime when imported


def _mapped_path(line: str) -> str:
    """The file of a /proc/self/maps line (its sixth field, which may hold spaces; a replaced file's " (deleted)"
    dropped)."""
    path = line.rstrip("\n").split(None, 5)[-1]
    return path.removesuffix(" (deleted)")


def _torch_first(path: str) -> tuple[bool, str]:
    """torch's own libgomp before any other a package brought (scikit-learn's wheels carry one): pausing another
    runtime would leave torch's pools, the ones that slow the engine, as they are."""
    torch = sys.modules.get("torch")
    lib = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib") if torch is not None else None
    return (lib is None or not path.startswith(lib + os.sep)), path
