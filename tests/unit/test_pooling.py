"""Pooling's pure parts: the worker's ``Pooler`` over chunks (the vector a whole-prompt forward gives), the
pooling defaults read from sentence-transformers folders (both config formats), OpenAI's base64 encoding."""

from __future__ import annotations

import base64
import json
import os
import struct

import pytest
import torch

from ember.errors import ConfigError
from ember.model_loader.pooler import max_seq_length, pooler_defaults
from ember.protocol import PoolingParams
from ember.server.embeddings import encode
from ember.worker.input_batch import PoolingRows
from ember.worker.pooler import Pooler


def _chunks(pooler: Pooler, hidden: torch.Tensor, params: PoolingParams, cuts: list[int]) -> list[float]:
    """Feed one sequence's hidden states to the pooler in chunks ending at ``cuts``, each in its own step next to
    another sequence's rows; the vector after the last."""
    out, start = {}, 0
    for end in cuts:
        other = torch.randn(3, hidden.shape[1])  # rows of another sequence first in the step
        step = torch.cat([other, hidden[start:end]])
        out = pooler(step, [PoolingRows(7, 3, end - start, start, end == len(hidden), params)])
        start = end
    return out[7]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooler_over_chunks_equals_whole_prompt(kind):
    torch.manual_seed(0)
    hidden = torch.randn(20, 8)
    expect = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    pooler = Pooler()
    whole = _chunks(pooler, hidden, PoolingParams(kind, False), [20])
    chunked = _chunks(pooler, hidden, PoolingParams(kind, False), [5, 6, 13, 20])
    torch.testing.assert_close(torch.tensor(whole), expect)
    torch.testing.assert_close(torch.tensor(chunked), expect, atol=1e-6, rtol=1e-6)
    assert pooler.partial == {}  # nothing kept once the vector is out


def test_pooler_dimensions_then_normalize_and_forget():
    hidden = torch.tensor([[3.0, 4.0, 12.0], [1.0, 1.0, 1.0]])
    pooler = Pooler()
    got = _chunks(pooler, hidden, PoolingParams("cls", True, 2), [2])
    assert got == pytest.approx([0.6, 0.8])  # [3, 4] / 5: cut to 2 values, then unit length
    pooler(hidden, [PoolingRows(9, 0, 1, 0, False, PoolingParams("mean", False))])
    assert 9 in pooler.partial
    pooler.forget([9])  # preempted or finished: it restarts from its first token
    assert pooler.partial == {}


def _folder(tmp_path, pooling_conf: dict | None, normalize: bool, bert_conf: dict | None = None,
            tokenizer_conf: dict | None = None) -> str:
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling_conf is not None:
        mods.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        os.makedirs(tmp_path / "1_Pooling")
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_conf))
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    if bert_conf is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(bert_conf))
    if tokenizer_conf is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_conf))
    return str(tmp_path)


def test_pooler_defaults_legacy_folder(tmp_path):
    path = _folder(tmp_path, {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, True,
                   {"max_seq_length": 256, "do_lower_case": False})
    d = pooler_defaults(path, encoder_only=True)
    assert (d.pooling, d.normalize, d.max_seq_length) == ("mean", True, 256)


def test_pooler_defaults_sentence_transformers_6_folder(tmp_path):
    path = _folder(tmp_path, {"embedding_dimension": 64, "pooling_mode": "lasttoken"}, False, {},
                   {"model_max_length": 512})
    d = pooler_defaults(path, encoder_only=False)
    assert (d.pooling, d.normalize, d.max_seq_length) == ("last", False, 512)


def test_pooler_defaults_without_files_and_unsupported_modes(tmp_path):
    assert pooler_defaults(str(tmp_path), encoder_only=True).pooling == "cls"  # vLLM's defaults
    assert pooler_defaults(str(tmp_path), encoder_only=False).pooling == "last"
    assert max_seq_length(str(tmp_path)) is None
    bad = _folder(tmp_path, {"pooling_mode": "max"}, False, None, {"model_max_length": int(1e30)})
    with pytest.raises(ConfigError, match=r"pooling mode \['max'\] is not supported"):
        pooler_defaults(bad, encoder_only=True)
    assert max_seq_length(bad) is None  # transformers' "no limit" is not a limit


def test_base64_is_little_endian_float32():
    vec = [0.5, -1.25, 3.0e-8]
    text = encode(vec, "base64")
    raw = base64.b64decode(text)
    assert raw == struct.pack("<3f", *vec)
    assert encode(vec, "float") == vec


def test_folder_without_pooling_module_takes_the_models_default(tmp_path):
    path = _folder(tmp_path, None, True)
    for encoder, kind in ((True, "cls"), (False, "last")):
        d = pooler_defaults(path, encoder_only=encoder)
        assert (d.pooling, d.normalize) == (kind, True)
