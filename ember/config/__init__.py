"""Engine configuration, one file per concern.

``EngineConfig`` (``engine.py``) holds what the user asked for, frozen and checked before any work starts: each
field's range is declared once (``checks.py``) and a bad value raises ``ConfigError``, a ``ValueError``, naming the
field, the value and what is allowed. ``EngineConfig.resolve`` derives, once, the frozen parts each layer reads:
``ModelConfig`` (``model.py``: what to load, where), ``CacheConfig`` (``cache.py``: KV pool and prefix cache, the
memory fraction with where it came from), ``ParallelConfig`` (``parallel.py``); ``SchedulerConfig``
(``scheduler.py``) follows once the model's length limit is known. ``ModelShape`` holds the facts every layer
derives from a checkpoint's config. Nothing here imports torch or a layer (``tests/unit/test_architecture.py``).
"""

from ember.config.cache import KV_CACHE_DTYPES, CacheConfig, available_memory_bytes, is_ratio, parse_bytes
from ember.config.engine import EngineConfig, ResolvedConfig
from ember.config.model import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    DTYPE_ALIASES,
    FLOAT_DTYPES,
    INT4_GROUP_SIZES,
    QUANT_ALGORITHMS,
    QUANT_METHODS,
    QUANT_MODES,
    LoRAConfig,
    ModelConfig,
    ModelShape,
    canonical_dtype,
    default_model_path,
)
from ember.config.parallel import EXECUTOR_BACKENDS, ParallelConfig
from ember.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from ember.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "DTYPE_ALIASES", "EXECUTOR_BACKENDS", "FLOAT_DTYPES",
           "INT4_GROUP_SIZES", "KV_CACHE_DTYPES", "QUANT_ALGORITHMS", "QUANT_METHODS", "QUANT_MODES",
           "SCHEDULING_POLICIES", "SPECULATIVE_METHODS", "CacheConfig", "EngineConfig", "LoRAConfig", "ModelConfig",
           "ModelShape", "ParallelConfig", "ResolvedConfig", "SchedulerConfig", "SpeculativeConfig",
           "available_memory_bytes", "canonical_dtype", "default_model_path", "is_ratio", "parse_bytes"]
