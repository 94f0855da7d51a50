"""Hand-crafted hostile files, one lie each: the reader refuses them with a ConfigError naming the file and what is
wrong, before anything is sized from the lie (the allocation bound is measured). The seeded mutator over real files
is tests/e2e/test_fuzz_files.py."""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc

import numpy as np
import pytest
import torch
from gguf_writer import (GGUF_ARRAY, GGUF_STRING, GGUF_U32, gguf_kv, gguf_string, gguf_tensor_info, raw_gguf,
                         small_gguf_kvs)

from ember.config import ModelShape
from ember.errors import BadRequestError, ConfigError
from ember.model_loader.checkpoint import model_config, open_checkpoint
from ember.model_loader.gguf_file import GGUFFile
from ember.model_loader.weight_checks import checked_weights

F32 = 0
HIDDEN, VOCAB = 32, 16


def _tensors(names_shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[bytes], bytes]:
    """F32 tensor entries (GGUF dims, innermost first) laid out one after another, and their data (ones)."""
    infos, data = [], b""
    for name, dims in names_shapes:
        infos.append(gguf_tensor_info(name, dims, F32, len(data)))
        data += np.ones(math.prod(dims), dtype=np.float32).tobytes()
        data += b"\0" * (-len(data) % 32)
    return infos, data


def _valid_gguf(kvs: list[bytes] | None = None) -> bytes:
    infos, data = _tensors([("token_embd.weight", (HIDDEN, VOCAB)), ("blk.0.attn_norm.weight", (HIDDEN,))])
    return raw_gguf(kvs if kvs is not None else small_gguf_kvs(hidden=HIDDEN, vocab=VOCAB), infos, data)


def _write(tmp_path, name: str, data: bytes) -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _refused(path: str, *needles: str) -> str:
    """open + config raise ConfigError naming the file and each needle."""
    with pytest.raises(ConfigError) as e:
        model_config(open_checkpoint(path))
    message = str(e.value)
    assert os.path.basename(path) in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_valid_hand_made_gguf_opens(tmp_path):
    """The base every lie below changes: it opens, and its config is what the header says."""
    config = model_config(open_checkpoint(_write(tmp_path, "ok.gguf", _valid_gguf())))
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (VOCAB, HIDDEN, 1)


def test_gguf_shape_larger_than_the_file(tmp_path):
    infos = [gguf_tensor_info("token_embd.weight", (4096, 4096), F32, 0)]
    _refused(_write(tmp_path, "big-shape.gguf", raw_gguf(small_gguf_kvs(), infos, b"\0" * 64)),
             "token_embd.weight", "the file has")


def test_gguf_offset_past_the_end(tmp_path):
    infos = [gguf_tensor_info("token_embd.weight", (HIDDEN, VOCAB), F32, 1 << 40)]
    _refused(_write(tmp_path, "offset.gguf", raw_gguf(small_gguf_kvs(), infos, b"\0" * 64)),
             "token_embd.weight", str(1 << 40))


def test_gguf_shape_product_overflowing_64_bits(tmp_path):
    infos = [gguf_tensor_info("token_embd.weight", (1 << 32, 1 << 32, 1 << 32, 1 << 32), F32, 0)]
    _refused(_write(tmp_path, "overflow.gguf", raw_gguf(small_gguf_kvs(), infos, b"\0" * 64)), "token_embd.weight")


def test_gguf_huge_tensor_count(tmp_path):
    _refused(_write(tmp_path, "n-tensors.gguf", raw_gguf(small_gguf_kvs(), [], n_tensors=1 << 62)),
             f"n_tensors={1 << 62}")


def test_gguf_huge_metadata_count(tmp_path):
    _refused(_write(tmp_path, "n-kv.gguf", raw_gguf(small_gguf_kvs(), [], n_kv=(1 << 64) - 1)), "n_kv=")


def test_gguf_vocabulary_array_of_2_40_entries(tmp_path):
    tokens = gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, struct.pack("<IQ", GGUF_STRING, 1 << 40) + gguf_string("a"))
    _refused(_write(tmp_path, "vocab.gguf", raw_gguf([*small_gguf_kvs(), tokens], [])),
             "tokenizer.ggml.tokens", str(1 << 40))


def test_gguf_vocabulary_string_length_near_2_64(tmp_path):
    """A vocabulary entry (an array of strings: the path that skips them in one loop) whose length runs past the
    file, or wraps a 64-bit offset, is refused naming the key and the length."""
    for length in (1 << 40, (1 << 64) - 1):
        words = struct.pack("<IQ", GGUF_STRING, 2) + gguf_string("a") + gguf_string("b", length=length)
        data = raw_gguf([*small_gguf_kvs(), gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, words)], [])
        _refused(_write(tmp_path, f"vocab{length}.gguf", data), "tokenizer.ggml.tokens", f"length {length}",
                 "past the end")


def test_gguf_arrays_nested_10000_deep(tmp_path):
    nested = struct.pack("<IQ", GGUF_ARRAY, 1) * 10_000 + struct.pack("<IQ", GGUF_U32, 0)
    _refused(_write(tmp_path, "nested.gguf", raw_gguf([*small_gguf_kvs(), gguf_kv("x", GGUF_ARRAY, nested)], [])),
             "nests arrays deeper")


def test_gguf_string_length_past_the_file(tmp_path):
    value = gguf_kv("general.name", GGUF_STRING, gguf_string("short", length=1 << 50))
    _refused(_write(tmp_path, "string.gguf", raw_gguf([*small_gguf_kvs(), value], [])), "general.name", "past the end")
    key = gguf_string("k", length=1 << 63) + struct.pack("<I", GGUF_U32)
    _refused(_write(tmp_path, "key.gguf", raw_gguf([key], [])), "metadata key", "past the end")


def test_gguf_unknown_types(tmp_path):
    infos = [gguf_tensor_info("token_embd.weight", (HIDDEN, VOCAB), 999, 0)]
    _refused(_write(tmp_path, "ggml-type.gguf", raw_gguf(small_gguf_kvs(), infos, b"\0" * 4096)),
             "token_embd.weight", "ggml type 999")
    _refused(_write(tmp_path, "value-type.gguf", raw_gguf([*small_gguf_kvs(), gguf_kv("x", 77, b"\0")], [])),
             "value type 77")


def test_gguf_dims_and_alignment_out_of_range(tmp_path):
    infos = [gguf_tensor_info("token_embd.weight", (HIDDEN, VOCAB), F32, 0, n_dims=1 << 31)]
    _refused(_write(tmp_path, "n-dims.gguf", raw_gguf(small_gguf_kvs(), infos, b"\0" * 4096)), "n_dims=")
    for align in (0, 3):
        kvs = [*small_gguf_kvs(), gguf_kv("general.alignment", GGUF_U32, struct.pack("<I", align))]
        _refused(_write(tmp_path, f"align-{align}.gguf", raw_gguf(kvs, [])), f"general.alignment={align}")


def test_gguf_every_truncation_is_refused(tmp_path):
    """A valid file cut at every byte of its header and every 61st of its data: none opens, every one is named."""
    data = _valid_gguf()
    header = len(_valid_gguf()) - len(_tensors([("token_embd.weight", (HIDDEN, VOCAB)),
                                                ("blk.0.attn_norm.weight", (HIDDEN,))])[1])
    path = str(tmp_path / "cut.gguf")
    for n in [*range(header), *range(header, len(data), 61)]:
        with open(path, "wb") as f:
            f.write(data[:n])
        with pytest.raises(ConfigError, match="cut.gguf"):
            GGUFFile(path)


def test_gguf_config_that_lies_about_the_tensors(tmp_path):
    """Sizes the model would be built from, against the tensors the file holds."""
    kvs = small_gguf_kvs(layers=1000, hidden=HIDDEN, vocab=VOCAB)
    _refused(_write(tmp_path, "layers.gguf", _valid_gguf(kvs)), "num_hidden_layers=1000", "1 layers")
    kvs = small_gguf_kvs(hidden=HIDDEN, vocab=1 << 20)
    _refused(_write(tmp_path, "vocab-lie.gguf", _valid_gguf(kvs)), "embed_tokens",
             "vocab_size")
    kvs = small_gguf_kvs(hidden=HIDDEN, vocab=1 << 30)
    _refused(_write(tmp_path, "vocab-huge.gguf", _valid_gguf(kvs)), f"vocab_size={1 << 30}", "out of range")
    kvs = small_gguf_kvs(hidden=HIDDEN, vocab=VOCAB, heads=0)
    _refused(_write(tmp_path, "heads.gguf", _valid_gguf(kvs)))


def test_gguf_metadata_of_a_wrong_type(tmp_path):
    kvs = [kv for kv in small_gguf_kvs(hidden=HIDDEN, vocab=VOCAB) if b"block_count" not in kv]
    kvs.append(gguf_kv("llama.block_count", GGUF_STRING, gguf_string("many")))
    _refused(_write(tmp_path, "typed.gguf", _valid_gguf(kvs)), "metadata")


def test_gguf_tokenizer_larger_than_the_embedding(tmp_path):
    """A vocabulary of VOCAB + 1 tokens over VOCAB embedding rows: ids the model has no row for."""
    words = struct.pack("<IQ", GGUF_STRING, VOCAB + 1) + b"".join(gguf_string(f"t{i}") for i in range(VOCAB + 1))
    kvs = [*small_gguf_kvs(hidden=HIDDEN, vocab=VOCAB), gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, words)]
    _refused(_write(tmp_path, "tok.gguf", _valid_gguf(kvs)), f"{VOCAB + 1} tokens", f"vocab_size={VOCAB}")


def test_failed_open_of_a_1kb_hostile_file_allocates_little(tmp_path):
    """Counts promising 2**62 tensors, a 2**40-entry array and a 2**50-byte string, in a file of under 1 KB: the
    open fails having allocated no more than a few MB (tracemalloc sees Python's and numpy's allocations)."""
    cases = [raw_gguf(small_gguf_kvs(), [], n_tensors=1 << 62),
             raw_gguf([*small_gguf_kvs(), gguf_kv("a", GGUF_ARRAY, struct.pack("<IQ", GGUF_U32, 1 << 40))], []),
             raw_gguf([*small_gguf_kvs(), gguf_kv("s", GGUF_STRING, gguf_string("x", length=1 << 50))], []),
             raw_gguf(small_gguf_kvs(), [gguf_tensor_info("w", (1 << 20, 1 << 20), F32, 0)])]
    for i, data in enumerate(cases):
        assert len(data) < 1024
        path = _write(tmp_path, f"alloc-{i}.gguf", data)
        tracemalloc.start()
        try:
            with pytest.raises(ConfigError):
                GGUFFile(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, (i, peak)


# ----- safetensors (a Hugging Face folder) -----

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
             intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=64, tie_word_embeddings=True)


def _st_bytes(header: dict, body: bytes, length: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + body


def _hf_folder(tmp_path, name: str, weights: bytes, **config) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **config}))
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def _embedding_st() -> bytes:
    n = VOCAB * HIDDEN * 4
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [VOCAB, HIDDEN], "data_offsets": [0, n]},
              "model.layers.0.input_layernorm.weight": {"dtype": "F32", "shape": [HIDDEN],
                                                        "data_offsets": [n, n + HIDDEN * 4]}}
    return _st_bytes(header, b"\0" * (n + HIDDEN * 4))


def test_valid_hand_made_folder_opens(tmp_path):
    assert model_config(open_checkpoint(_hf_folder(tmp_path, "ok", _embedding_st()))).vocab_size == VOCAB


def test_safetensors_header_length_past_the_file(tmp_path):
    for length in (10_000, 1 << 62):
        folder = _hf_folder(tmp_path, f"len-{length}", _st_bytes({}, b"", length=length))
        _refused(folder, "model.safetensors", "header")


def test_safetensors_wrong_dtype_and_offsets(tmp_path):
    bad_dtype = _st_bytes({"model.embed_tokens.weight": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 8]}},
                          b"\0" * 8)
    _refused(_hf_folder(tmp_path, "dtype", bad_dtype), "model.safetensors", "Q99")
    past = _st_bytes({"model.embed_tokens.weight": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 1 << 32]}},
                     b"\0" * 8)
    _refused(_hf_folder(tmp_path, "past", past), "model.safetensors")


def test_config_json_that_lies_about_the_tensors(tmp_path):
    _refused(_hf_folder(tmp_path, "vocab", _embedding_st(), vocab_size=1 << 40), "vocab_size", "out of range")
    _refused(_hf_folder(tmp_path, "rows", _embedding_st(), vocab_size=1000), "model.embed_tokens.weight", "[1000, 32]")
    _refused(_hf_folder(tmp_path, "layers", _embedding_st(), num_hidden_layers=900), "num_hidden_layers=900")
    _refused(_hf_folder(tmp_path, "hidden", _embedding_st(), hidden_size=True), "hidden_size")


def test_config_json_not_json(tmp_path):
    folder = _hf_folder(tmp_path, "json", _embedding_st())
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("[" * 100_000)
    _refused(folder, "config.json")


def test_weight_checks_refuse_nan_inf_and_odd_dtypes():
    ok = [("w", torch.ones(4)), ("q", torch.zeros(4, dtype=torch.int8)), ("big", torch.full((4,), 3e38))]
    assert [n for n, _ in checked_weights("m.safetensors", ok)] == ["w", "q", "big"]  # big: its sum overflows
    for bad, needle in ((torch.tensor([1.0, float("nan")]), "holds 1 NaN"), (torch.tensor([float("-inf")]), "infinite"),
                        (torch.zeros(2, dtype=torch.complex64), "complex64")):
        with pytest.raises(ConfigError, match=needle) as e:
            list(checked_weights("m.safetensors", [("model.norm.weight", bad)]))
        assert "m.safetensors" in str(e.value) and "model.norm.weight" in str(e.value)


# ----- LoRA adapters: requests name them, so their errors are BadRequestError naming the adapter -----

SHAPE = ModelShape(num_layers=1, hidden_size=HIDDEN, num_heads=4, num_kv_heads=4, head_dim=8, vocab_size=VOCAB,
                   max_position=64, intermediate_size=64)


def _adapter(tmp_path, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _lora(r: int = 2, dtype=torch.float32, fill: float = 0.1) -> dict[str, torch.Tensor]:
    p = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{p}.lora_A.weight": torch.full((r, HIDDEN), fill, dtype=dtype),
            f"{p}.lora_B.weight": torch.full((HIDDEN, r), fill, dtype=dtype)}


@pytest.mark.parametrize("case", ["ok", "r-string", "r-zero-weights", "alpha-nan", "pattern-list", "dtype", "nan"])
def test_hostile_lora_adapters(tmp_path, case):
    from ember.lora.adapter import read_adapter

    cfg = dict(peft_type="LORA", r=2, lora_alpha=4, target_modules=["q_proj"])
    tensors = _lora()
    needle = {"r-string": "r='2'", "r-zero-weights": "do not fit", "alpha-nan": "lora_alpha=nan",
              "pattern-list": "rank_pattern", "dtype": "I32", "nan": "NaN"}.get(case)
    if case == "r-string":
        cfg["r"] = "2"
    elif case == "r-zero-weights":
        tensors = _lora(r=0)
    elif case == "alpha-nan":
        cfg["lora_alpha"] = float("nan")
    elif case == "pattern-list":
        cfg["rank_pattern"] = [1, 2]
    elif case == "dtype":
        tensors = {k: v.int() for k, v in tensors.items()}
    elif case == "nan":
        tensors = _lora(fill=float("nan"))
    path = _adapter(tmp_path, case, cfg, tensors)
    if needle is None:
        adapter = read_adapter(path, "a", SHAPE, 16)
        assert adapter.weights[(0, "q_proj")].scaling == 2.0
        return
    with pytest.raises(BadRequestError, match=needle) as e:
        read_adapter(path, "a", SHAPE, 16)
    assert case in str(e.value)


# ----- .asmodel -----

def test_asmodel_meta_that_lies(tmp_path):
    from ember.model_loader import asmodel

    param = tmp_path / "m.asparam"
    param.write_bytes(_embedding_st())
    index = asmodel._header_index(str(param))
    meta = {"format": asmodel.FORMAT, "format_version": asmodel.FORMAT_VERSION, "dtype": "float32",
            "config": dict(LLAMA), "tokenizer": {},
            "weights": {"file": "m.asparam", "tensors": index, "bytes": param.stat().st_size}}
    cases = {"outside": ({"weights": {**meta["weights"], "file": "../m.asparam"}}, "not a file name"),
             "size": ({"weights": {**meta["weights"], "bytes": 5}}, "truncated or replaced"),
             "config": ({"config": [1, 2]}, "config is list"),
             "tokenizer": ({"tokenizer": {"../evil.json": "{}"}}, "plain file names"),
             "index": ({"weights": {**meta["weights"], "tensors": {"x": ["float32", [1]]}}}, "do not match")}
    for name, (change, needle) in cases.items():
        path = _write(tmp_path, f"{name}.asmodel", json.dumps({**meta, **change}).encode())
        _refused(path, needle)
    path = _write(tmp_path, "truncated.asmodel", json.dumps(meta).encode()[:-10])
    _refused(path, "not an ember .asmodel file")


def test_tokenizer_of_another_model_is_refused(caplog):
    """BOS / EOS past the model's rows: the tokenizer is another model's. A larger vocabulary alone is logged."""
    from types import SimpleNamespace

    from ember.model_loader import check_tokenizer

    check_tokenizer("tok", SimpleNamespace(bos_token_id=1, eos_token_id=2, vocab_size=VOCAB), VOCAB)
    with pytest.raises(ConfigError, match=f"eos_token_id={VOCAB + 5} is out of range") as e:
        check_tokenizer("tok-dir", SimpleNamespace(bos_token_id=1, eos_token_id=VOCAB + 5, vocab_size=VOCAB), VOCAB)
    assert "tok-dir" in str(e.value)
    with caplog.at_level("WARNING", logger="ember"):
        check_tokenizer("big", SimpleNamespace(bos_token_id=1, eos_token_id=2, vocab_size=VOCAB * 2), VOCAB)
    assert f"{VOCAB * 2} tokens" in caplog.text


def test_gguf_tokenizer_of_the_wrong_types_is_refused(tmp_path):
    """A vocabulary of numbers where strings belong: transformers' GGUF conversion fails; the error names the file."""
    from ember.tokenizer import Tokenizer

    numbers = struct.pack("<IQ", GGUF_U32, VOCAB) + struct.pack(f"<{VOCAB}I", *range(VOCAB))
    kvs = [*small_gguf_kvs(hidden=HIDDEN, vocab=VOCAB),
           gguf_kv("tokenizer.ggml.model", GGUF_STRING, gguf_string("gpt2")),
           gguf_kv("tokenizer.ggml.tokens", GGUF_ARRAY, numbers)]
    path = _write(tmp_path, "tok-types.gguf", _valid_gguf(kvs))
    with pytest.raises(ConfigError, match="tok-types.gguf"):
        Tokenizer.load(path, gguf_file=path)
