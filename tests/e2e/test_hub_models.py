"""A model named by hub id: a tiny random Llama copied into a Hugging Face cache snapshot (laid out as
huggingface_hub lays it out) loads offline as "tiny-org/tiny-llama" and gives the same greedy tokens as its folder;
the EasyDeL, TensorRT-LLM and DashInfer facades and ``ember serve``'s model name take the id too."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest
from conftest import random_prompts
from huggingface_hub import constants

import ember.compat.easydel as ed
from ember import LLM, SamplingParams

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cached_llama(llama_dir, tmp_path, monkeypatch) -> str:
    """The tiny Llama as the snapshot of REPO_ID in a fresh cache, offline; the snapshot folder."""
    cache = str(tmp_path / "hub")
    repo = os.path.join(cache, "models--" + REPO_ID.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", COMMIT)
    shutil.copytree(llama_dir, snap)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", cache)  # a process started by the engine reads these at its import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)  # this process imported huggingface_hub before
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snap


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model, dtype="float32", kv_cache_memory="16MiB", device="cpu")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_a_hub_id_loads_offline_like_its_folder(cached_llama, llama_dir):
    prompts = random_prompts(3, 4, 20, 49152, seed=5)
    assert _greedy(REPO_ID, prompts) == _greedy(llama_dir, prompts)


def test_facades_and_serve_take_a_hub_id(cached_llama):
    from ember.server.launch import _names

    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(REPO_ID, dtype="float32")
    assert os.path.samefile(model.path, cached_llama) and model.engine_settings["model"] == model.path
    from ember.compat.dashinfer.allspark.model_loader import HuggingFaceModel
    from ember.compat.tensorrt_llm.hlapi.config import ModelConfig

    assert os.path.samefile(ModelConfig(model_dir=REPO_ID).model_path, cached_llama)
    assert os.path.samefile(HuggingFaceModel(REPO_ID, "tiny").hf_model_path, cached_llama)
    args = argparse.Namespace(served_model_name=None)
    assert _names(args, REPO_ID) == (REPO_ID,)  # clients name it as they name it on the hub
    assert _names(args, os.path.join(cached_llama, "")) == (COMMIT,)  # a folder: its name, as before
