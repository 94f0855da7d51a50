"""Which ids a draft model may propose for a model (``shared_vocabulary``): those both embed, where both tokenizers
spell every shared id alike; a draft without a tokenizer of its own is the model's where the rows agree."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ember.config import ModelConfig
from ember.errors import ConfigError
from ember.model_loader import shared_vocabulary


def _config(path: str) -> ModelConfig:
    return ModelConfig(path, None, "float32", "cpu", None, None, None, 0, None)


def _folder(tokenizer_dir: str, out: str, swap: tuple[int, int] | None = None, tokenizer: bool = True) -> str:
    """A model folder holding only a tokenizer (ids ``swap`` exchanged) or nothing of one."""
    os.makedirs(out)
    if tokenizer:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), out)
    if swap is not None:
        path = os.path.join(out, "tokenizer.json")
        with open(path) as f:
            spec = json.load(f)
        vocab = spec["model"]["vocab"]
        a, b = (next(t for t, i in vocab.items() if i == x) for x in swap)
        vocab[a], vocab[b] = swap[1], swap[0]
        with open(path, "w") as f:
            json.dump(spec, f)
    return out


def test_the_ids_both_embed_of_one_tokenizer(tokenizer_dir, tmp_path):
    model = _config(_folder(tokenizer_dir, str(tmp_path / "model")))
    same = _config(_folder(tokenizer_dir, str(tmp_path / "same")))
    assert shared_vocabulary(same, model, 49216, 49152) == 49152  # the draft's padding rows are never proposed
    assert shared_vocabulary(same, model, 49152, 50000) == 49152
    assert shared_vocabulary(model, model, 50000, 50304) == 50000  # one folder: no tokenizer read
    other = _config(_folder(tokenizer_dir, str(tmp_path / "other"), swap=(5000, 5001)))
    with pytest.raises(ConfigError, match=r"its tokenizer has .* at id 5000 where the model's has .*: a draft model "
                                          r"must share the model's tokenizer"):
        shared_vocabulary(other, model, 49152, 49152)


def test_a_draft_without_a_tokenizer_is_the_models_only_where_the_rows_agree(tokenizer_dir, tmp_path):
    model = _config(_folder(tokenizer_dir, str(tmp_path / "model")))
    bare = _config(_folder(tokenizer_dir, str(tmp_path / "bare"), tokenizer=False))
    assert shared_vocabulary(bare, model, 49152, 49152) == 49152
    with pytest.raises(ConfigError, match=r"its tokenizer cannot be read and its 49216 vocabulary rows differ from the "
                                          r"model's 49152"):
        shared_vocabulary(bare, model, 49216, 49152)
