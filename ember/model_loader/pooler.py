"""A checkpoint's pooling defaults, read as sentence-transformers reads its folder: ``modules.json`` lists the
modules (Transformer, then Pooling, then Normalize when the vectors are unit length), the Pooling module's
``config.json`` says which pooling (``pooling_mode_*`` booleans before sentence-transformers 6, one
``pooling_mode`` name since), the longest input is ``sentence_bert_config.json``'s max_seq_length (before 6) or the
tokenizer's model_max_length (6 keeps it there). Without those files: an encoder pools its first ([CLS]) token, a
decoder its last, both normalised (vLLM's defaults for embedding)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ember.errors import ConfigError

# sentence-transformers' Pooling modes (legacy boolean keys and the names since 6) -> ember's pooling types
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_NAMES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}


@dataclass(frozen=True, slots=True)
class PoolerDefaults:
    pooling: str | None  # one of protocol.POOLING_TYPES (None only from ``folder_pooler``: not set by the folder)
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' input limit (None: the model's positions)


def _read(path: str) -> dict | list | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def max_seq_length(path: str) -> int | None:
    """The longest input of a sentence-transformers folder (None: not such a folder, or it sets none)."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "modules.json")):
        return None
    conf = _read(os.path.join(path, "sentence_bert_config.json"))
    value = conf.get("max_seq_length") if isinstance(conf, dict) else None
    if not value:
        tok = _read(os.path.join(path, "tokenizer_config.json"))
        value = tok.get("model_max_length") if isinstance(tok, dict) else None
        value = value if isinstance(value, int) and value < 1 << 24 else None  # transformers' "no limit": 1e30
    return int(value) if value else None


def _pooling(file: str) -> str:
    conf = _read(file) or {}
    if "pooling_mode" in conf:
        modes = conf["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [k for k in conf if k.startswith("pooling_mode_") and conf[k]]
    chosen = [_NAMES.get(m) or _MODES.get(m) for m in modes]
    if len(chosen) != 1 or chosen[0] is None:
        raise ConfigError(f"{file}: pooling mode {modes} is not supported: ember pools with one of "
                          f"{sorted(_NAMES)} (the legacy {sorted(_MODES)})")
    return chosen[0]


def pooler_defaults(path: str, encoder_only: bool) -> PoolerDefaults:
    """The folder's defaults (``folder_pooler``) completed with vLLM's for the kind of model."""
    return with_model_defaults(folder_pooler(path), encoder_only)


def with_model_defaults(found: PoolerDefaults | None, encoder_only: bool) -> PoolerDefaults:
    kind = "cls" if encoder_only else "last"
    if found is None:
        return PoolerDefaults(kind, True, None)
    return found if found.pooling is not None else replace(found, pooling=kind)


def folder_pooler(path: str) -> PoolerDefaults | None:
    """The defaults a sentence-transformers folder sets (pooling None: it has no Pooling module); None: not such a
    folder. An unsupported pooling mode raises ConfigError, so a client reads this before starting its engine."""
    modules = _read(os.path.join(path, "modules.json")) if os.path.isdir(path) else None
    if not isinstance(modules, list):
        return None
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            pooling = _pooling(os.path.join(path, module.get("path", ""), "config.json"))
        elif kind.endswith(".Normalize"):
            normalize = True
    return PoolerDefaults(pooling, normalize, max_seq_length(path))
