"""Every environment variable ember reads, in one place, each read when asked (tests set them per case).

| variable | meaning | default |
|---|---|---|
| ``EMBER_MEM_RATIO`` | memory fraction when ``kv_cache_memory_fraction`` is not given, in (0, 1] | 0.9 CUDA, 0.1 CPU |
| ``EMBER_CPU_KERNELS`` | ``0`` turns ember's compiled CPU kernels off (every one has a torch fallback) | on |
| ``EMBER_EMULATE_AVX512`` | ``1`` builds the AVX512-BF16 kernels over scalar stand-ins (tests on other CPUs; slow) | off |
| ``EMBER_CPU_AMX`` | ``0`` keeps the int4 and int8 kernels off AMX where the CPU has it (AVX512-BF16 throughout) | on |
| ``EMBER_MKLDNN_LINEAR`` | ``0`` turns oneDNN's pre-packed CPU linear weights off | on |
| ``EMBER_CACHE_DIR`` | cache folder (compiled kernels, converted models) | ``$XDG_CACHE_HOME/ember`` |
| ``EMBER_PREPARED_CACHE`` | ``0`` turns the prepared-model cache off; else a size bounding it (``model_loader/prepared.py``) | ``4GiB`` |
| ``EMBER_HOST_TIER_ON_CPU`` | ``1`` runs the host KV tier on a CPU engine (tests of its bookkeeping) | off |
| ``EMBER_DIST_TIMEOUT`` | seconds a collective of a split model may wait before it fails (a hung rank) | 600 |
| ``EMBER_API_KEY`` | the key ``ember serve`` requires (``Bearer KEY``) when ``--api-key`` is not given | none |
| ``EMBER_ENGINE_CORE_PROCESS`` | ``1`` runs the engine core in its own process (``uni``, ``mp`` executors), ``0`` on a thread | ``1`` on CUDA (``uni``), else ``0`` |
| ``EMBER_LAUNCH_SHARED_STORE`` | ``1`` (set by ``trtllm-hlapi-launch``): launched engines meet its worker nodes | unset |
| ``EMBER_BENCH_VENVS`` | where ``benchmarks/setup_baselines.sh`` put the baselines' environments | ``.bench/venvs`` |

A split model started by a launcher reads the launcher's own variables: ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``
(torchrun), else ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` (Open MPI's mpirun), else ``SLURM_PROCID`` /
``SLURM_NTASKS`` / ``SLURM_LOCALID`` (srun); the ranks on this machine (``LOCAL_WORLD_SIZE`` and its MPI / Slurm
names), and ``MASTER_ADDR`` / ``MASTER_PORT`` (where rank 0 listens).

Facades add their own names for these (DashInfer's ``BFC_MEM_RATIO``) in ``ember/compat``, passed in as
configuration: nothing below the front end reads a facade's variable.
"""

from __future__ import annotations

import os

from ember.errors import ConfigError

MEM_RATIO = "EMBER_MEM_RATIO"
CPU_KERNELS = "EMBER_CPU_KERNELS"
MKLDNN_LINEAR = "EMBER_MKLDNN_LINEAR"
CPU_AMX = "EMBER_CPU_AMX"
EMULATE_AVX512 = "EMBER_EMULATE_AVX512"
CACHE_DIR = "EMBER_CACHE_DIR"
HOST_TIER_ON_CPU = "EMBER_HOST_TIER_ON_CPU"
BENCH_VENVS = "EMBER_BENCH_VENVS"
DIST_TIMEOUT = "EMBER_DIST_TIMEOUT"
API_KEY = "EMBER_API_KEY"
ENGINE_CORE_PROCESS = "EMBER_ENGINE_CORE_PROCESS"
LAUNCH_SHARED_STORE = "EMBER_LAUNCH_SHARED_STORE"
PREPARED_CACHE = "EMBER_PREPARED_CACHE"


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    return default if raw is None else raw != "0"


def mem_ratio() -> float | None:
    """EMBER_MEM_RATIO as a fraction in (0, 1]; None when unset."""
    return ratio_from(MEM_RATIO, os.environ.get(MEM_RATIO))


def ratio_from(name: str, raw: str | None) -> float | None:
    """A memory fraction read from a variable (ember's or a facade's alias), checked to lie in (0, 1]."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ConfigError(f"{name}={raw!r} is out of range: it must be a number in (0, 1]")
    return value


def cpu_kernels_enabled() -> bool:
    return _flag(CPU_KERNELS, True)


def cpu_amx_enabled() -> bool:
    return _flag(CPU_AMX, True)


def emulate_avx512() -> bool:
    return _flag(EMULATE_AVX512, False)


def mkldnn_linear_enabled() -> bool:
    return _flag(MKLDNN_LINEAR, True)


def engine_core_process() -> bool | None:
    """EMBER_ENGINE_CORE_PROCESS: '1' (the core in its own process), '0' (in the caller's) or unset (None: the
    device's default); anything else is refused."""
    raw = os.environ.get(ENGINE_CORE_PROCESS, "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{ENGINE_CORE_PROCESS}={raw!r} is not supported: use 1 (the engine core in its own "
                          "process) or 0 (in the caller's), or leave it unset for the device's default")
    return None if raw == "" else raw == "1"


def host_tier_on_cpu() -> bool:
    return os.environ.get(HOST_TIER_ON_CPU) == "1"


def cache_root() -> str:
    return os.environ.get(CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember")


def prepared_cache_bytes() -> int:
    """EMBER_PREPARED_CACHE as bytes: 0 (off) or the size the prepared-model cache may take."""
    from ember.config.cache import parse_bytes  # ember.config reads this module: imported when asked

    raw = os.environ.get(PREPARED_CACHE, "4GiB")
    value = parse_bytes(raw, PREPARED_CACHE)
    if value < 0:
        raise ConfigError(f"{PREPARED_CACHE}={raw!r} is out of range: use 0 (off) or a size such as '4GiB'")
    return value


def bench_venvs() -> str:
    return os.environ.get(BENCH_VENVS, os.path.join(".bench", "venvs"))


def dist_timeout() -> float:
    raw = os.environ.get(DIST_TIMEOUT, "600")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ConfigError(f"{DIST_TIMEOUT}={raw!r} is out of range: it must be a number of seconds > 0")
    return value


_LAUNCHERS = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
              ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def launcher_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) set by a launcher (torchrun, mpirun, srun), or None outside one."""
    for rank, world, local in _LAUNCHERS:
        if os.environ.get(rank) is not None and os.environ.get(world) is not None:
            try:
                return int(os.environ[rank]), int(os.environ[world]), int(os.environ.get(local, "0"))
            except ValueError as e:
                raise ConfigError(f"{rank}={os.environ[rank]!r} / {world}={os.environ[world]!r} are not "
                                  "integers") from e
    return None


def local_world_size() -> int | None:
    """Ranks a launcher started on this machine (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
    SLURM_NTASKS_PER_NODE)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return None


def master_address() -> tuple[str, str] | None:
    """MASTER_ADDR and MASTER_PORT, when both are set."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, port) if addr and port else None


def api_key() -> str | None:
    """EMBER_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY) or None
