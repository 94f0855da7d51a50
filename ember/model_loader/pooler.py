"""A checkpoint's pooling defaults, read as sentence-transformers reads its folder: ``modules.json`` lists the
modules (Transformer, then Pooling, then Normalize when the vectors are unit length), the Pooling module's
``config.json`` says which pooling, ``sentence_bert_config.json`` the longest input. Without those files: an
encoder pools its first ([CLS]) token, a decoder its last, both normalised (vLLM's defaults for embedding)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ember.errors import ConfigError

# sentence-transformers' Pooling modes -> ember's pooling types
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class PoolerDefaults:
    pooling: str  # one of protocol.POOLING_TYPES
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' input limit (None: the model's positions)


def _read(path: str) -> dict | list | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def max_seq_length(path: str) -> int | None:
    """``sentence_bert_config.json``'s max_seq_length, if the folder has one."""
    conf = _read(os.path.join(path, "sentence_bert_config.json")) if os.path.isdir(path) else None
    value = conf.get("max_seq_length") if isinstance(conf, dict) else None
    return int(value) if value else None


def pooler_defaults(path: str, encoder_only: bool) -> PoolerDefaults:
    modules = _read(os.path.join(path, "modules.json")) if os.path.isdir(path) else None
    if not isinstance(modules, list):
        return PoolerDefaults("cls" if encoder_only else "last", True, None)
    pooling = "cls" if encoder_only else "last"
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            file = os.path.join(path, module.get("path", ""), "config.json")
            conf = _read(file) or {}
            bad = [m for m in _UNSUPPORTED if conf.get(m)]
            if bad:
                raise ConfigError(f"{file}: {bad[0]}=true is not supported: ember pools with one of "
                                  f"{sorted(_MODES)}")
            chosen = [t for m, t in _MODES.items() if conf.get(m)]
            if len(chosen) != 1:
                raise ConfigError(f"{file}: pooling modes {chosen or 'none'} are not supported: set exactly one "
                                  f"of {sorted(_MODES)}")
            pooling = chosen[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return PoolerDefaults(pooling, normalize, max_seq_length(path))
