"""The prepared-model cache's bookkeeping (ember/model_loader/prepared.py): what its key follows, entries that do
not load or cannot be saved, the budget, the activation records. Whole engines mapping a model from it:
tests/e2e/test_prepared_model.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from ember.config import ModelConfig
from ember.distributed import ParallelContext
from ember.errors import ConfigError
from ember.layers.linear import PrepackedWeight, linear, mkldnn_prepack_available
from ember.model_loader import prepared


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The entries in a folder of this test's (the compiled kernels stay in the shared cache: no rebuild)."""
    monkeypatch.setattr(prepared, "cache_dir", lambda *parts: os.path.join(tmp_path, "cache", *parts))
    monkeypatch.setenv("EMBER_PREPARED_CACHE", "1GiB")
    return tmp_path / "cache" / "prepared"


def _config(path: str, **changes) -> ModelConfig:
    settings = dict(path=path, tokenizer=None, dtype="auto", device="cpu", quantization=None, quant_group_size=None,
                    quantize_embeddings=None, seed=0, num_threads=None)
    return ModelConfig(**{**settings, **changes})


def test_the_key_follows_the_checkpoint_the_settings_and_the_switches(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    key = prepared.entry_key(_config(str(gguf)), ParallelContext())
    assert key is not None and key == prepared.entry_key(_config(str(gguf)), ParallelContext())
    others = [prepared.entry_key(_config(str(gguf), dtype="bfloat16"), ParallelContext()),
              prepared.entry_key(_config(str(gguf), quantization="int8"), ParallelContext()),
              prepared.entry_key(_config(str(gguf), batch_invariant=False), ParallelContext()),
              prepared.entry_key(_config(str(gguf), int8_activations=True), ParallelContext())]
    monkeypatch.setenv("EMBER_CPU_AMX", "0")
    others.append(prepared.entry_key(_config(str(gguf)), ParallelContext()))
    monkeypatch.delenv("EMBER_CPU_AMX")
    st = os.stat(gguf)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file rewritten
    others.append(prepared.entry_key(_config(str(gguf)), ParallelContext()))
    assert len({key, *others}) == 7

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    before = prepared.entry_key(_config(str(folder)), ParallelContext())
    (folder / "model.safetensors").write_bytes(bytes(8))
    assert prepared.entry_key(_config(str(folder)), ParallelContext()) != before


def test_no_key_off_cpu_for_a_split_model_or_when_turned_off(tmp_path, monkeypatch):
    path = str(tmp_path / "m.gguf")
    open(path, "wb").close()
    assert prepared.entry_key(_config(path, device="cuda"), ParallelContext()) is None
    assert prepared.entry_key(_config(path), ParallelContext(tp_size=2)) is None
    monkeypatch.setenv("EMBER_PREPARED_CACHE", "0")
    assert prepared.entry_key(_config(path), ParallelContext()) is None
    monkeypatch.setenv("EMBER_PREPARED_CACHE", "lots")
    with pytest.raises(ConfigError, match="EMBER_PREPARED_CACHE='lots'"):
        prepared.entry_key(_config(path), ParallelContext())


def test_an_entry_loads_back_with_its_tensors_and_modules():
    value = {"w": torch.randn(16, 8), "module": os}  # a layer may hold a module: the compiled kernels
    value["same"] = value["w"]
    prepared.save("k1", value)
    loaded = prepared.load("k1")
    assert torch.equal(loaded["w"], value["w"]) and loaded["module"] is os
    assert loaded["same"] is loaded["w"]  # shared tensors stay shared (a tied LM head)


def test_a_damaged_entry_is_removed_and_the_model_built_again(cache):
    prepared.save("k2", {"w": torch.ones(4)})
    (cache / "k2" / "model.pt").write_bytes(b"not a torch file")
    assert prepared.load("k2") is None
    assert not (cache / "k2").exists()
    assert prepared.load("k3") is None  # no entry at all


def test_what_cannot_be_pickled_is_marked_once_and_not_tried_again(cache, monkeypatch):
    prepared.save("k4", {"f": lambda: 0})
    assert "cannot be pickled" in (cache / "k4" / "unsavable.txt").read_text()
    assert prepared.load("k4") is None and not any(p.startswith("model.pt") for p in os.listdir(cache / "k4"))

    def fail(*args, **kwargs):
        raise AssertionError("saved again")

    monkeypatch.setattr(torch, "save", fail)
    prepared.save("k4", {"w": torch.ones(1)})


def test_the_budget_removes_the_least_recently_used_entries(cache, monkeypatch):
    monkeypatch.setenv("EMBER_PREPARED_CACHE", str(int(2.5 * 2**20)))
    for i, key in enumerate(("old", "mid")):
        prepared.save(key, {"w": torch.zeros(2**18)})  # 1 MiB each
        os.utime(cache / key, (1000 + i, 1000 + i))
    prepared.load("old")  # used now: newer than "mid"
    prepared.save("new", {"w": torch.zeros(2**18)})
    assert sorted(os.listdir(cache)) == ["new", "old"]
    prepared.save("huge", {"w": torch.zeros(2**20)})  # 4 MiB: over the budget on its own
    assert "exceed EMBER_PREPARED_CACHE" in (cache / "huge" / "unsavable.txt").read_text()
    assert prepared.load("huge") is None and prepared.load("new") is not None


def test_activation_records_belong_to_an_entry():
    prepared.record_activation_bytes("k5", "probe", 123)  # no entry: nothing kept
    assert prepared.activation_bytes("k5", "probe") is None
    prepared.save("k5", {"w": torch.ones(1)})
    prepared.record_activation_bytes("k5", "probe", 123)
    prepared.record_activation_bytes("k5", "other", 7)
    assert prepared.activation_bytes("k5", "probe") == 123 and prepared.activation_bytes("k5", "other") == 7
    assert prepared.activation_bytes("k5", "unknown") is None and prepared.activation_bytes(None, "probe") is None


@pytest.mark.skipif(not mkldnn_prepack_available(torch.float32), reason="oneDNN cannot pre-pack weights here")
def test_a_prepacked_weight_pickles_as_its_weight_and_packs_again():
    torch.manual_seed(0)
    w, x = torch.randn(48, 32), torch.randn(5, 32)
    packed = PrepackedWeight(w)
    again = pickle.loads(pickle.dumps(packed))
    assert torch.equal(again.weight, w)
    assert torch.equal(linear(x, w, None, again), linear(x, w, None, packed))


def test_a_cache_that_cannot_be_written_only_logs(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would have to be inside a file: every write fails
    monkeypatch.setattr(prepared, "cache_dir", lambda *parts: os.path.join(blocker, *parts))
    prepared.save("k6", {"w": torch.ones(1)})
    prepared.record_activation_bytes("k6", "probe", 1)
    assert prepared.load("k6") is None and "not saved in the prepared cache" in caplog.text
