"""Which reader a checkpoint path takes (Hugging Face folder, GGUF file, .asmodel pair, TensorRT-LLM folder), and what
can be said of a checkpoint before its weights are read."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

from ember.errors import ConfigError, EmberError
from ember.model_loader.asmodel import AsModelCheckpoint
from ember.model_loader.config_checks import check_config, check_tensor_shapes
from ember.model_loader.gguf import GGUFCheckpoint
from ember.model_loader.hf import HFCheckpoint
from ember.model_loader.trtllm import TRTLLMCheckpoint, trtllm_folder_kind
from ember.quantization import QuantConfig

logger = logging.getLogger("ember")

Checkpoint = HFCheckpoint | GGUFCheckpoint | AsModelCheckpoint | TRTLLMCheckpoint


def open_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at path, by kind: a .gguf file, an .asmodel file, a TensorRT-LLM checkpoint folder (its
    config.json has TensorRT-LLM's singular "architecture"), else a Hugging Face folder."""
    if path.endswith(".gguf"):
        try:
            st = os.stat(path)
        except OSError:
            return GGUFCheckpoint(path)  # raises the reader's clear error
        return _open_gguf(path, st.st_size, st.st_mtime_ns)
    with file_errors(path):
        if path.endswith(".asmodel"):
            return AsModelCheckpoint(path)
        if trtllm_folder_kind(path) is not None:
            return TRTLLMCheckpoint(path)  # an engine folder is refused there, clearly
        return HFCheckpoint(path)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFCheckpoint:
    """Parsing a GGUF file's metadata takes seconds (measured: 2.8 s for the default 135M model on 2 cores) and the
    front end (tokenizer), the engine core (limits) and the worker (weights) each open it: they share one parse."""
    return GGUFCheckpoint(path)


def model_config(ckpt: Checkpoint) -> Any:
    """The config the engine builds from: a GGUF file's comes from its metadata alone (transformers' config classes
    take ~0.8 s to import, most of a CLI start-up), every other kind's is transformers' own. Checked (the GGUF
    reader checks its own) against sane bounds and the tensors the files hold: everything is sized from it."""
    if isinstance(ckpt, GGUFCheckpoint):
        return ckpt.model_config()
    with file_errors(ckpt.path):
        config = ckpt.hf_config()
        check_config(ckpt.path, config)
        if not isinstance(ckpt, TRTLLMCheckpoint):  # its rank files are checked against config.json as it joins them
            check_tensor_shapes(ckpt.path, config, ckpt.tensor_shapes())
    return config


@contextlib.contextmanager
def file_errors(path: str) -> Iterator[None]:
    """What a damaged checkpoint makes the libraries raise (safetensors, transformers' config classes, an index
    past a short list) as ConfigError naming the checkpoint: a bad file is the user's to fix, not a traceback."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        yield
    except EmberError:  # ConfigError already naming what is wrong, DoesNotFitError, ...
        raise
    except (SafetensorError, StrictDataclassError, OSError, ValueError, KeyError, IndexError, TypeError,
            AttributeError, ZeroDivisionError, OverflowError, RecursionError, RuntimeError) as e:
        logger.debug("loading %s failed", path, exc_info=True)  # EMBER_LOG_LEVEL=DEBUG shows where
        raise ConfigError(f"model={path!r} cannot be loaded: {type(e).__name__}: {e} (a damaged or inconsistent "
                          "file; if the file is sound, this is a bug in ember: the traceback is chained)") from e


def needs_calibration(ckpt: Checkpoint, quant: QuantConfig | None) -> bool:
    """Whether loading quant from ckpt runs its calibrated algorithm first: yes, unless the checkpoint is an
    .asmodel that stores the weights already transformed and quantized (``ember convert --quantization awq``)."""
    if quant is None or quant.algorithm is None:
        return False
    return not (isinstance(ckpt, AsModelCheckpoint) and ckpt.native_quantization() is not None)
