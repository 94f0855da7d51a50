"""Models named by hub id (ember.config.hub): a name that is no local path but reads as ``org/name`` resolves to
its snapshot in a Hugging Face cache laid out as huggingface_hub lays it out; offline, a missing id fails naming
the id and the cache; a local path wins over an id of the same spelling; a malformed name is neither."""

from __future__ import annotations

import json
import os
import sys

import huggingface_hub
import pytest
from huggingface_hub import constants

from ember.config import EngineConfig, hub
from ember.config.model import model_path
from ember.errors import ConfigError

COMMIT = "a" * 40
COMMIT_V1 = "b" * 40


def add_snapshot(cache: str, repo_id: str, commit: str, ref: str = "main", files: dict[str, str] | None = None) -> str:
    """models--org--name/refs/<ref> holding the commit, and snapshots/<commit>/ with the files (as
    huggingface_hub writes them, less the blobs they link to)."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", ref), "w") as f:
        f.write(commit)
    for name, text in (files or {"config.json": json.dumps({"model_type": "llama"})}).items():
        with open(os.path.join(snap, name), "w") as f:
            f.write(text)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> str:
    """An empty hub cache, offline: HF_HUB_CACHE / HF_HUB_OFFLINE set, and the values huggingface_hub read at its
    import patched to match."""
    cache = str(tmp_path / "hub")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("name, ok", [("gpt2", True), ("Qwen/Qwen3-8B", True), ("org/name.v2_1", True),
                                      ("a/b/c", False), ("has space/x", False), ("org/-x", False),
                                      ("org--x/y", False), ("org/../x", False), ("/abs/path", False),
                                      ("~/m", False), ("./m", False), ("model.gguf", False),
                                      ("org/m.asmodel", False), ("", False)])
def test_what_reads_as_a_hub_id(name, ok):
    assert hub.is_hub_id(name) is ok


def test_a_cached_id_resolves_offline_to_its_snapshot(hf_cache):
    snap = add_snapshot(hf_cache, "org/name", COMMIT)
    assert os.path.samefile(hub.resolve("org/name"), snap)
    assert os.path.samefile(model_path("org/name"), snap)


def test_a_revision_resolves_to_its_own_snapshot(hf_cache):
    main = add_snapshot(hf_cache, "org/name", COMMIT)
    v1 = add_snapshot(hf_cache, "org/name", COMMIT_V1, ref="v1")
    assert os.path.samefile(hub.resolve("org/name", "v1"), v1)
    assert os.path.samefile(model_path("org/name", revision="v1"), v1)
    assert os.path.samefile(hub.resolve("org/name", COMMIT), main)  # a commit hash names its snapshot directly
    with pytest.raises(ConfigError, match="revision 'v2'"):
        hub.resolve("org/name", "v2")


def test_a_missing_id_offline_names_the_id_and_the_cache(hf_cache):
    with pytest.raises(ConfigError) as e:
        model_path("org/absent")
    msg = str(e.value)
    assert "'org/absent'" in msg and "revision 'main'" in msg and hf_cache in msg
    assert "HF_HUB_OFFLINE is set" in msg and "pass a local path" in msg and "hf download org/absent" in msg


def test_offline_set_after_import_is_honoured(hf_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the library read it unset; the user set it since

    def no_network(*args, local_files_only=False, **kwargs):
        assert local_files_only, "a download was tried with HF_HUB_OFFLINE=1"
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        hub.resolve("org/absent")


def test_online_a_missing_id_is_downloaded_into_the_cache(hf_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake(repo_id, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, cache_dir, local_files_only))
        assert "*.safetensors" in allow_patterns and "*.json" in allow_patterns
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return add_snapshot(cache_dir, repo_id, COMMIT)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hub.resolve("org/new").endswith(COMMIT)
    assert calls == [("org/new", "main", hf_cache, True), ("org/new", "main", hf_cache, False)]

    def failing(repo_id, local_files_only=False, **kwargs):
        raise (huggingface_hub.errors.LocalEntryNotFoundError("not cached") if local_files_only
               else OSError("no route to host"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ConfigError, match="could not be downloaded.*no route to host.*pass a local path"):
        hub.resolve("org/other")


def test_a_local_path_wins_over_a_hub_id_of_the_same_spelling(hf_cache, tmp_path, monkeypatch):
    add_snapshot(hf_cache, "org/name", COMMIT)
    local = tmp_path / "work" / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "work")
    assert hub.resolve("org/name") == "org/name"
    assert os.path.samefile(model_path("org/name"), local)


@pytest.mark.parametrize("name", ["a/b/c", "has space/model", "org/name with spaces"])
def test_a_malformed_name_is_neither_a_path_nor_a_hub_id(hf_cache, name):
    with pytest.raises(ConfigError, match=r"is neither a path on this machine \(it does not exist\) nor a hub id"):
        model_path(name)


def test_a_missing_absolute_path_still_says_it_does_not_exist(hf_cache, tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*a Hugging Face folder"):
        model_path(str(tmp_path / "nowhere"))


def test_a_tokenizer_named_by_hub_id_resolves_too(hf_cache, tmp_path):
    snap = add_snapshot(hf_cache, "org/tok", COMMIT, files={"tokenizer.json": "{}"})
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    resolved = EngineConfig(model=str(model), tokenizer="org/tok", device="cpu").resolve().model
    assert os.path.samefile(resolved.tokenizer, snap) and resolved.path == str(model)
    with pytest.raises(ConfigError, match="tokenizer='org/none'.*not in the Hugging Face cache"):
        EngineConfig(model=str(model), tokenizer="org/none", device="cpu").resolve()


def test_modelscope_ids_without_modelscope_fail_clearly(hf_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not importable, whether installed or not
    with pytest.raises(ConfigError, match="org/ms-only.*modelscope package is not installed"):
        hub.resolve("org/ms-only", modelscope=True)
    snap = add_snapshot(hf_cache, "org/both", COMMIT)  # in the Hugging Face cache: ModelScope is not needed
    assert os.path.samefile(hub.resolve("org/both", modelscope=True), snap)


def test_huggingface_hub_is_imported_only_for_a_hub_id():
    import subprocess

    code = ("import sys, ember.config.model as m\n"
            "try:\n    m.model_path('/no/such/model')\nexcept ValueError:\n    pass\n"
            "print('huggingface_hub' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
