"""Every API serves the families beyond Llama: a random Gemma 3 (float32) through `ember serve`, the TensorRT-LLM
HLAPI, EasyDeL's vSurge and DashInfer (serialized, then served) gives the native engine's greedy tokens, which
tests/e2e/test_families.py checks against transformers."""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import save_random_model
from server_utils import running_server

from ember import LLM, SamplingParams

PROMPT = [100, 2000, 3000, 400, 50, 600, 7000]
NEW = 12


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir) -> str:
    return save_random_model("Gemma3TextConfig", str(tmp_path_factory.mktemp("gemma3")), tokenizer_dir,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=4,
                             sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                             max_position_embeddings=1024)


@pytest.fixture(scope="module")
def native(gemma3):
    """The native engine's greedy completion of PROMPT (token ids and text), stopping at EOS as the facades do."""
    with LLM(gemma3, dtype="float32", max_num_seqs=4, kv_cache_memory="16MiB") as llm:
        return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)[0].outputs[0]


def test_server(gemma3, native):
    from openai import OpenAI

    with running_server("--model", gemma3, "--dtype", "float32", "--kv-cache-memory", "16MiB") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=NEW,
                                        temperature=0)
    assert out.choices[0].text == native.text


def test_tensorrt_llm(gemma3, native):
    from ember.compat.tensorrt_llm import LLM as TrtLLM
    from ember.compat.tensorrt_llm import ModelConfig
    from ember.compat.tensorrt_llm.hlapi import SamplingConfig

    config = ModelConfig(model_dir=gemma3)
    config.dtype = "float32"
    with TrtLLM(config) as llm:
        out = llm.generate([PROMPT], sampling_config=SamplingConfig(max_new_tokens=NEW))[0]
    assert out.token_ids == native.token_ids


def test_easydel(gemma3, native):
    import ember.compat.easydel as ed

    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(gemma3, dtype="float32")
    surge = ed.vSurge.from_model(model, None, max_concurrent_decodes=2, max_prefill_length=64)
    surge.start()
    try:
        text = surge.processor.decode(PROMPT)
        params = ed.SamplingParams(max_tokens=NEW, temperature=0.0)
        result = asyncio.run(surge.generate(text, params))[0]
    finally:
        surge.stop()
    with LLM(gemma3, dtype="float32", max_num_seqs=2, kv_cache_memory="16MiB") as llm:
        want = llm.generate(text, SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)[0].outputs[0].text
    assert result.text[0] == want


def test_dashinfer(gemma3, native, tmp_path):
    from ember.compat.dashinfer import allspark
    from ember.compat.dashinfer.allspark import AsStatus, GenerateRequestStatus, HuggingFaceModel, TargetDevice

    loader = HuggingFaceModel(gemma3, "tiny/gemma3", user_set_data_type="float32")
    loader.load_model().serialize_to_path(None, str(tmp_path)).free_model()
    assert os.path.isfile(tmp_path / "tiny_gemma3.asmodel")
    engine = allspark.Engine()
    runtime = loader.create_reference_runtime_config_builder("m", TargetDevice.CPU, [0], max_batch=2) \
        .max_length(256).build()
    engine.install_model(runtime)
    engine.start_model("m")
    try:
        gen = loader.create_reference_generation_config_builder(runtime)
        gen.update({"top_k": 1, "early_stopping": False, "max_length": len(PROMPT) + NEW})
        status, handle, queue = engine.start_request_ids("m", loader, PROMPT, gen)
        assert status is AsStatus.ALLSPARK_SUCCESS
        ids: list[int] = []
        while queue.GenerateStatus() not in (GenerateRequestStatus.GenerateFinished,
                                             GenerateRequestStatus.InternalError):
            el = queue.Get()
            if el is not None:
                ids += el.ids_from_generate
        engine.release_request("m", handle)
    finally:
        engine.stop_model("m")
    assert ids == native.token_ids
