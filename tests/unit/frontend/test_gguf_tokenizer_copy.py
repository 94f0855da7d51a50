"""A GGUF whose tokenizer transformers builds with a model-specific class (Qwen2Tokenizer here: the default model's
vocabulary written under Qwen2's architecture) loads through transformers once, then from the copy of the pipeline
transformers built, checked against it on probes (``ember.tokenizer._check_fast_copy``): the same token ids, text and
special ids as transformers' own tokenizer, and transformers again when the check is stale or failed."""

from __future__ import annotations

import json
import os

import pytest
from conftest import default_gguf

from ember import tokenizer as tokenizer_module
from ember.tokenizer import Tokenizer

TEXTS = ["The capital of France is", "e\u0301 caf\u00e9 \uff21", "<|im_start|>user\nhi<|im_end|>\n", "\u4e2d\u6587 42",
         "  two  spaces\r\n", ""]


def _qwen2_gguf(path: str) -> str:
    """The default model's tokenizer keys in a GGUF of architecture qwen2 (no tensors: only the tokenizer is read)."""
    import gguf

    reader = gguf.GGUFReader(default_gguf())
    writer = gguf.GGUFWriter(path, "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.ggml.pre":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            values = [field.parts[i] for i in field.data]
            writer.add_array(key, [bytes(v).decode() if field.types[1] == gguf.GGUFValueType.STRING
                                   else v.tolist()[0] for v in values])
        elif field.types[0] == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], field.types[0])
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def gguf_path(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # a fresh conversion (no kernels built here)
    return _qwen2_gguf(str(tmp_path / "qwen2-vocab.gguf"))


def test_the_checked_copy_encodes_and_decodes_as_transformers(gguf_path):
    first = Tokenizer.load(gguf_path, gguf_file=gguf_path)
    assert type(first.hf).__name__ == "Qwen2Tokenizer" and first._fast is None  # transformers, then the check
    second = Tokenizer.load(gguf_path, gguf_file=gguf_path)
    assert second._fast is not None
    hf = first.hf
    assert (second.vocab_size, second.eos_token_id, second.bos_token_id) == (len(hf), hf.eos_token_id,
                                                                            hf.bos_token_id)
    for text in TEXTS:
        for add in (True, False):
            ids = list(hf.encode(text, add_special_tokens=add))
            assert second.encode(text, add_special_tokens=add) == ids
            for skip in (True, False):
                assert second.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_a_stale_or_failed_check_loads_through_transformers(gguf_path, monkeypatch):
    Tokenizer.load(gguf_path, gguf_file=gguf_path)
    monkeypatch.setattr(tokenizer_module, "_transformers_version", lambda: "0.0.0")  # transformers upgraded
    assert Tokenizer.load(gguf_path, gguf_file=gguf_path)._fast is None  # and checked again for that version
    assert Tokenizer.load(gguf_path, gguf_file=gguf_path)._fast is not None
    monkeypatch.undo()
    folder = tokenizer_module._gguf_tokenizer_folder(gguf_path)
    with open(os.path.join(folder, tokenizer_module._FAST_CHECK), "w") as f:
        json.dump({"transformers": tokenizer_module._transformers_version(), "same": False}, f)
    assert Tokenizer.load(gguf_path, gguf_file=gguf_path)._fast is None


def test_a_tokenizer_whose_calls_differ_from_its_pipeline_keeps_transformers(gguf_path, tmp_path):
    """The check compares calls, not files: a class that changes ids in Python (here every encode starts with an
    extra id) gets no copy."""
    hf = Tokenizer.load(gguf_path, gguf_file=gguf_path).hf

    class Shifted:
        backend_tokenizer = hf.backend_tokenizer

        def __len__(self) -> int:
            return len(hf)

        def __getattr__(self, name):
            return getattr(hf, name)

        def encode(self, text, add_special_tokens=True):
            return [0, *hf.encode(text, add_special_tokens=add_special_tokens)]

    folder = tmp_path / "converted"
    folder.mkdir()
    tokenizer_module._check_fast_copy(str(folder), Shifted())
    with open(folder / tokenizer_module._FAST_CHECK) as f:
        assert json.load(f)["same"] is False
    assert not (folder / tokenizer_module._FAST_COPY).exists()
