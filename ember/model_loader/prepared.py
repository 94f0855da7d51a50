"""Finished CPU models kept on disk, so that a second start maps the model instead of building it again.

A model's load reads every tensor, repacks quantized blocks into the kernels' layouts and finalizes each layer:
0.22 s of the default model's 1.3 s ``ember generate``, seconds for a 1.5B model. After a first load the whole
``LoadedModel`` is saved once under the cache folder (``prepared/KEY/model.pt``); a later load of the same
checkpoint with the same settings, ember code, torch, kernels and CPU maps it back with ``torch.load(mmap=True)``
(the weights are pages of that file, read as they are touched: 14 ms for the default model, its decode speed
unchanged). Each entry also keeps what start-up measured of a step's activations (``activation_bytes``), so a
second start skips that dummy forward.

An entry is a pickle, trusted as the compiled kernels in the same cache folder are: whoever can write there can
already run code in ember's process. The key covers every input of the finished model, conservatively: the
checkpoint's files (size, modification time), the load settings, the stat of every ember source file, torch's
version, the kernel build, the CPU's flags and the EMBER_* switches that pick kernels. A model that cannot be
pickled is marked as such once and loads as before (oneDNN's packed weights pickle as their source weight).
``EMBER_PREPARED_CACHE``: ``0`` turns the cache off; a size (default 4GiB) bounds the folder, the least recently
used entries removed first.
CPU only, one rank (a split model's ranks each hold another slice).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import pickle
import platform
import shutil
import tempfile
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from ember import envs
from ember.cache import cache_dir, file_key, replace_with
from ember.config import ModelConfig
from ember.distributed import ParallelContext

logger = logging.getLogger("ember")

_MODEL = "model.pt"
_ACTIVATIONS = "activations.json"
_UNSAVABLE = "unsavable.txt"  # why this entry holds no model: it cannot be pickled, or is bigger than the budget
_SWITCHES = (envs.CPU_KERNELS, envs.CPU_AMX, envs.EMULATE_AVX512, envs.MKLDNN_LINEAR)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ember/


def entry_key(config: ModelConfig, parallel: ParallelContext) -> str | None:
    """The entry a load with these settings reads and writes; None when the cache is off or does not apply."""
    if envs.prepared_cache_bytes() == 0 or parallel.world_size != 1 or torch.device(config.device).type != "cpu":
        return None
    from ember.kernels import cpu_kernels

    kernels = cpu_kernels()
    digest = hashlib.sha1()
    for part in (_checkpoint_stat(config.path), _file_stat(config.calibration_data),
                 repr((config.dtype, config.device, config.quantization, config.quant_group_size,
                       config.quantize_embeddings, config.batch_invariant, config.int8_activations,
                       config.tokenizer)),
                 _source_stat(), torch.__version__, kernels.__name__ if kernels is not None else "no kernels",
                 platform.machine(), _cpu_flags(), repr([(k, os.environ.get(k)) for k in _SWITCHES])):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def load(key: str) -> Any | None:
    """The entry's saved model (a ``LoadedModel``, checked by the caller), or None: no entry, or one that does not
    load (removed, so the next load saves it again)."""
    path = os.path.join(_folder(key), _MODEL)
    if not os.path.isfile(path):
        return None
    try:
        loaded = torch.load(path, mmap=True, weights_only=False)
    except Exception as e:  # a damaged or foreign file: the model is built from its checkpoint instead
        logger.warning("prepared model %s does not load (%s: %s): removed, loading from the checkpoint", path,
                       type(e).__name__, e)
        shutil.rmtree(_folder(key), ignore_errors=True)
        return None
    _touch(key)
    logger.info("model mapped from the prepared cache %s", path)
    return loaded


def save(key: str, loaded: Any) -> None:
    """Write the finished model as this key's entry (once; a concurrent writer's copy replaces it atomically), then
    bring the folder back under its budget. A cache that cannot be written (read-only, full) only logs why."""
    folder = _folder(key)
    if os.path.exists(os.path.join(folder, _UNSAVABLE)):
        return
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_MODEL, dir=folder)
        os.close(fd)
        try:
            torch.save(loaded, tmp, pickle_module=_PICKLE)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # objects pickle cannot take: built each time
            _mark_unsavable(folder, f"cannot be pickled: {type(e).__name__}: {e}")
            return
        budget, size = envs.prepared_cache_bytes(), os.path.getsize(tmp)
        if size > budget:
            _mark_unsavable(folder, f"its {size} bytes exceed {envs.PREPARED_CACHE}={budget} bytes")
            return
        os.replace(tmp, os.path.join(folder, _MODEL))
        tmp = None
        _touch(key)
        _evict(budget, keep=key)
    except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError when the disk is full
        logger.warning("model not saved in the prepared cache %s: %s", folder, e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


class _Pickler(pickle.Pickler):
    """A module a layer holds (the compiled kernels whose GEMM it calls) is saved by name and found again on load."""

    def reducer_override(self, obj: Any) -> Any:
        return (_module, (obj.__name__,)) if isinstance(obj, ModuleType) else NotImplemented


_PICKLE = SimpleNamespace(Pickler=_Pickler, __name__="pickle")  # what torch.save uses of a pickle module


def _module(name: str) -> ModuleType:
    from ember.kernels import cpu_kernels

    kernels = cpu_kernels()  # the entry's key holds the kernels' name: the same build
    return kernels if kernels is not None and kernels.__name__ == name else importlib.import_module(name)


def activation_bytes(key: str | None, probe: str) -> int | None:
    """The activation bytes start-up measured for ``probe`` (its dummy step's shape) on this entry's model."""
    if key is None:
        return None
    value = _read_activations(key).get(probe)
    return value if isinstance(value, int) and value >= 0 else None


def record_activation_bytes(key: str | None, probe: str, value: int) -> None:
    if key is None or not os.path.isfile(os.path.join(_folder(key), _MODEL)):
        return
    table = _read_activations(key)
    table[probe] = int(value)
    def write(path: str) -> None:
        with open(path, "w") as f:
            json.dump(table, f)

    try:
        replace_with(os.path.join(_folder(key), _ACTIVATIONS), write)
    except OSError as e:
        logger.warning("activation measure not kept in %s: %s", _folder(key), e)


def _read_activations(key: str) -> dict[str, Any]:
    try:
        with open(os.path.join(_folder(key), _ACTIVATIONS)) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _folder(key: str) -> str:
    return cache_dir("prepared", key)


def _touch(key: str) -> None:
    try:
        os.utime(_folder(key))
    except OSError:
        pass


def _mark_unsavable(folder: str, why: str) -> None:
    logger.info("model not kept in the prepared cache: %s", why)
    with open(os.path.join(folder, _UNSAVABLE), "w") as f:
        f.write(why + "\n")


def _evict(budget: int, keep: str) -> None:
    """Remove the least recently used entries until the folder holds at most ``budget`` bytes."""
    root = cache_dir("prepared")
    entries = []
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        try:
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            entries.append((os.path.getmtime(folder), size, name))
        except OSError:  # removed meanwhile by another process
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= budget:
            break
        if name != keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            total -= size


def _file_stat(path: str | None) -> str:
    return file_key(path) if path is not None and os.path.exists(path) else repr(path)


def _checkpoint_stat(path: str) -> str:
    """A file (a .gguf; an .asmodel with its .asparam beside it) or every file of a folder."""
    if os.path.isdir(path):
        return ";".join(_file_stat(os.path.join(path, f)) for f in sorted(os.listdir(path)))
    stem, ext = os.path.splitext(path)
    return ";".join(_file_stat(p) for p in (path, stem + ".asparam") if p == path or ext == ".asmodel")


def _source_stat() -> str:
    """Every ember source file's size and modification time: any change to the code builds the model again."""
    parts = []
    for folder, subfolders, files in os.walk(_PACKAGE):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        parts += [_file_stat(os.path.join(folder, f)) for f in sorted(files) if f.endswith((".py", ".cpp", ".h"))]
    return ";".join(parts)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()
