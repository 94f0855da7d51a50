"""A second engine on the same checkpoint maps the model its first one saved (ember/model_loader/prepared.py) and
answers exactly as the first did: the reference is the model built from the checkpoint, whose own parity with
transformers is tested elsewhere. The cache's bookkeeping alone: tests/unit/model_loader/test_prepared_cache.py."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import default_gguf

from ember import LLM, SamplingParams, model_loader
from ember.model_loader import prepared
from ember.worker import startup

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The cache on, in this test's folder; how often a model is built from its checkpoint and how often start-up
    runs its measuring prefill."""
    monkeypatch.setattr(prepared, "cache_dir", lambda *parts: os.path.join(tmp_path, *parts))
    monkeypatch.setenv("EMBER_PREPARED_CACHE", "2GiB")
    calls = {"build": 0, "measure": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(model_loader, "_build_model", count("build", model_loader._build_model))
    monkeypatch.setattr(startup, "dummy_prefill", count("measure", startup.dummy_prefill))
    return calls


def _answers(llm: LLM) -> tuple[list, list, int]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    activations = llm.stats()["activation_bytes"]
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], logprobs, activations


@pytest.mark.parametrize("kind", ["gguf-q4_1", "float32", "bfloat16"])
def test_a_second_engine_maps_the_model_and_answers_the_same(kind, llama_dir, counted):
    """Q4_1 blocks repacked for the int4 kernel (the default model), a float model whose layers hold the compiled
    kernels' module (float32, bf16): built once, then mapped; tokens and logprobs equal to the bit, and the second
    start takes the first one's activation measure instead of running the measuring prefill again."""
    path, dtype = (default_gguf(), "auto") if kind == "gguf-q4_1" else (llama_dir, kind)
    first = _answers(LLM(path, dtype=dtype, max_num_seqs=4, max_model_len=512))
    assert counted == {"build": 1, "measure": 1}
    second = _answers(LLM(path, dtype=dtype, max_num_seqs=4, max_model_len=512))
    assert counted == {"build": 1, "measure": 1}
    assert second == first


def test_the_mapped_weights_equal_the_built_ones(llama_dir, counted):
    from ember.config import EngineConfig

    config = EngineConfig(model=llama_dir, dtype="bfloat16").resolve().model
    built = model_loader.load_model(config)
    mapped = model_loader.load_model(config)
    assert counted["build"] == 1 and mapped.prepared_key == built.prepared_key is not None
    want, got = built.model.state_dict(), mapped.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_changed_checkpoint_is_built_again(tmp_path, tiny_models, counted):
    import shutil

    folder = shutil.copytree(tiny_models["qwen2"], tmp_path / "qwen2")
    _answers(LLM(str(folder), dtype="float32", max_num_seqs=2, max_model_len=256))
    config = folder / "config.json"
    st = os.stat(config)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _answers(LLM(str(folder), dtype="float32", max_num_seqs=2, max_model_len=256))
    assert counted["build"] == 2
