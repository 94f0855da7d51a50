"""The TensorRT-LLM HLAPI facade: the reference page's examples (tests/compat_scripts/trtllm_hlapi_examples.py)
on random Llamas (the multi-rank ones with CPU ranks) and, for saving a quantized engine, on the default model;
results checked against the native engine (itself checked against transformers in the parity tests); futures,
streaming, save, checkpoints, StreamingLLM and bad input. The facade builds its engines at TensorRT-LLM's default
limits (128 sequences, 4,096 tokens a step): small models keep those starts cheap."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import time

import pytest
import torch
from conftest import TESTS, default_gguf, random_prompts, save_random_model

from ember import LLM as NativeLLM
from ember import SamplingParams
from ember.compat.tensorrt_llm import LLM, ModelConfig
from ember.compat.tensorrt_llm.hlapi import GenerationOutput, SamplingConfig, StreamingLLMParam
from ember.compat.tensorrt_llm.quantization import QuantAlgo

sys.path.insert(0, os.path.join(TESTS, "compat_scripts"))
spec = importlib.util.spec_from_file_location("trtllm_hlapi_examples", os.path.join(
    TESTS, "compat_scripts", "trtllm_hlapi_examples.py"))
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)

PROMPT = "To tell a story"
DEFAULT_NEW = 32  # the facade's default max_new_tokens


def native_greedy(llm: NativeLLM, prompt, max_tokens: int = DEFAULT_NEW) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0] \
        .outputs[0].token_ids


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir) -> str:
    """The examples' <llama_model_path>: a random Llama with the default model's tokenizer, wide enough for AWQ's
    groups of 128 and long enough for TensorRT-LLM's default 512 + 200 tokens."""
    return save_random_model("LlamaConfig", str(tmp_path_factory.mktemp("llama")), tokenizer_dir, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=1024)


@pytest.fixture(scope="module")
def native(llama):
    llm = NativeLLM(llama, max_num_seqs=8, max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def basic(llama, native):
    """The basic-usage example's LLM (it printed its output; the test below reads it again)."""
    llm = ex.basic_usage(llama)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tokenizer_dir) -> str:
    """4 layers, 4 heads, 4 KV heads: tp 2 or 4, pp up to 4."""
    return save_random_model("LlamaConfig", str(tmp_path_factory.mktemp("llama4")), tokenizer_dir,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)


# ----- the reference's examples -----

def test_basic_usage_prints_results(basic, native, capsys):
    out = basic.generate([PROMPT])[0]
    # printed as the page's basic usage shows it (repr quotes the text with " when it holds an apostrophe)
    assert re.fullmatch(r"GenerationOutput\(text=('.+'|\".+\"), token_ids=\[[\d, ]+\], logprobs=\[\]\)", repr(out),
                        re.S)
    assert out.token_ids == native_greedy(native, PROMPT)  # TensorRT-LLM's default: greedy, 32 new tokens
    assert out.text == native.tokenizer.decode(out.token_ids)


def test_token_ids_give_ids_and_empty_text(llama, basic, native, capsys):
    for outputs in (ex.token_ids_input(basic), basic.generate([[32, 12]])):
        assert len(outputs) == 1 and outputs[0].text == ""
        assert outputs[0].token_ids == native_greedy(native, [32, 12])
    llm = ex.disabling_tokenizer(llama)
    llm.shutdown()
    assert re.search(r"GenerationOutput\(text='', token_ids=\[[\d, ]+\]", capsys.readouterr().out)


def test_asyncio_streaming_and_futures(llama, basic, capsys):
    llm = asyncio.run(ex.asyncio_generation(llama, PROMPT))
    try:
        printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GenerationOutput(")]
        assert len(printed) == DEFAULT_NEW  # one item per token while streaming
        final = basic.generate(PROMPT)[0]
        assert printed[-1] == repr(GenerationOutput(final.text, final.token_ids, []))
        assert ex.future_generation(llm, PROMPT).token_ids == final.token_ids
        assert asyncio.run(ex.future_generation_async(llm, PROMPT)).token_ids == final.token_ids
    finally:
        llm.shutdown()


def test_streaming_without_streaming_yields_the_final_output_only(basic):
    async def collect(streaming):
        return [o async for o in basic.generate_async(PROMPT, streaming=streaming)]

    items = asyncio.run(collect(False))
    streamed = asyncio.run(collect(True))
    assert len(items) == 1 and len(streamed) == DEFAULT_NEW
    assert streamed[-1].text == items[0].text and streamed[-1].token_ids == items[0].token_ids
    assert [o.text for o in basic.generate_async(PROMPT, streaming=True)][-1] == items[0].text  # sync iteration


def test_future_timeout_leaves_request_running_and_cancel_frees_blocks(basic):
    long = basic.get_default_sampling_config()
    long.max_new_tokens = 300
    long.min_length = 300  # EOS may not end it early
    gen = basic.generate_async(PROMPT, sampling_config=long)
    with pytest.raises(TimeoutError, match="goes on running"):
        gen.result(timeout=0.05)
    assert not gen.done()
    assert len(gen.result(timeout=120).token_ids) > 0 and gen.done()

    total = basic.client.stats()["kv_blocks_total"]
    gen = basic.generate_async(PROMPT, sampling_config=long)
    while not gen._merged:  # running, holding blocks
        time.sleep(0.01)
    assert gen.cancel() and gen.cancelled()
    with pytest.raises(Exception, match="cancelled"):
        gen.result(timeout=30)
    deadline = time.monotonic() + 10
    while basic.client.stats()["kv_blocks_free"] != total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert basic.client.stats()["kv_blocks_free"] == total

    async def cancel_awaiting():  # cancelling the task that awaits aresult() aborts the request too
        gen = basic.generate_async(PROMPT, sampling_config=long)
        task = asyncio.ensure_future(gen.aresult())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return gen

    gen = asyncio.run(cancel_awaiting())
    assert gen.cancelled()
    while not gen.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gen.finish_reasons == ["abort"]


def test_beam_search_example(llama, native, capsys):
    llm = ex.beam_search(llama, PROMPT)
    try:
        printed = capsys.readouterr().out
        assert re.match(r"GenerationOutput\(text=\[['\"]", printed)  # repr picks " when the text has an apostrophe
        out = llm.generate(PROMPT, sampling_config=_beams(llm, 4))[0]
        want = native.generate([PROMPT], SamplingParams(beam_width=4, n=4, temperature=0, max_tokens=DEFAULT_NEW),
                               use_tqdm=False)[0]
        assert out.token_ids == [c.token_ids for c in want.outputs] and len(out.text) == 4
        with pytest.raises(ValueError, match=r"beam_width=5 is out of range.*max_beam_width=4"):
            llm.generate(PROMPT, sampling_config=_beams(llm, 5))
    finally:
        llm.shutdown()


def _beams(llm, width):
    sc = llm.get_default_sampling_config()
    sc.beam_width = width
    return sc


def test_save_round_trip_of_the_default_model_keeps_its_int4_weights(tmp_path, capsys):
    engine = str(tmp_path / "engine")
    llm = ex.save_and_reload(default_gguf(), engine)
    try:
        assert sorted(os.listdir(engine)) == ["model.asmodel", "model.asparam"]
        with NativeLLM(default_gguf(), max_num_seqs=1, max_model_len=256) as native:
            assert llm.generate(PROMPT)[0].token_ids == native_greedy(native, PROMPT)
            assert llm.client.model_info.quantization == native.client.model_info.quantization  # int4 g32, as loaded
    finally:
        llm.shutdown()


def test_quantization_example_runs_awq(llama):
    llm = ex.quantization(llama)
    try:
        assert "awq" in llm.client.model_info.quantization
        assert len(llm.generate(PROMPT)[0].token_ids) == DEFAULT_NEW
    finally:
        llm.shutdown()


def test_runtime_customization_maps_onto_the_engine(llama):
    llm = ex.runtime_customization(llama)
    try:
        c = llm.engine_config
        assert c.kv_cache_memory_fraction == 0.8 and c.scheduling_policy == "guaranteed_no_evict"
        assert not c.enable_prefix_caching  # enable_block_reuse defaults to False
        assert llm.get_default_sampling_config().max_new_tokens == 128
    finally:
        llm.shutdown()


def test_custom_tokenizer_object_is_used(llama, tokenizer_dir, basic):
    from transformers import AutoTokenizer

    class Counting:
        def __init__(self):
            self.hf, self.calls = AutoTokenizer.from_pretrained(tokenizer_dir), 0
            self.eos_token_id, self.pad_token_id = self.hf.eos_token_id, self.hf.pad_token_id

        def encode(self, text):
            self.calls += 1
            return self.hf.encode(text, add_special_tokens=False)

        def decode(self, ids):
            self.calls += 1
            return self.hf.decode(ids)

    tok = Counting()
    llm = ex.tokenizer_customization(ModelConfig(model_dir=llama), tok)
    try:
        out = llm.generate(PROMPT)[0]
        assert tok.calls >= 2 and out.text == tok.hf.decode(out.token_ids)
        assert out.token_ids == basic.generate([basic.tokenizer.encode(PROMPT)])[0].token_ids
    finally:
        llm.shutdown()


# TensorRT-LLM's LLM API takes no device: its ranks are one GPU each, or CPU ranks (gloo) on a machine with none
needs_a_gpu_a_rank = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                        reason="the facade's split runs one rank a GPU and this machine has one")


@pytest.fixture(scope="module")
def tp2_tokens(llama4) -> list[int]:
    """The facade's dtype "auto" runs these float32 checkpoints in bf16 (as TensorRT-LLM runs them in fp16): the
    native engine with the same split is the reference (splits themselves are checked against transformers in
    test_parallel.py, the checkpoint reader in test_trtllm_checkpoint.py)."""
    with NativeLLM(llama4, tensor_parallel_size=2) as native:
        return native_greedy(native, [32, 12])


@needs_a_gpu_a_rank
def test_tensor_parallel_and_auto_parallel_examples(llama4, tp2_tokens):
    want = tp2_tokens
    for make in (ex.tensor_parallel, ex.auto_parallel):
        llm = make(llama4)
        try:
            assert llm.parallel_plan == (2, 1) and llm.client.model_info.tensor_parallel_size == 2
            assert llm.generate([32, 12])[0].token_ids == want
        finally:
            llm.shutdown()


@needs_a_gpu_a_rank
def test_pipeline_and_multi_node_examples(llama4, capsys):
    with NativeLLM(llama4) as native:  # stages split layers, not sums: bit for bit one rank's result
        want = native_greedy(native, [32, 12])
    llm = ex.pipeline_parallel(llama4)
    try:
        assert llm.client.model_info.pipeline_parallel_size == 4
        assert llm.generate([[32, 12]])[0].token_ids == want
    finally:
        llm.shutdown()
    with NativeLLM(llama4, tensor_parallel_size=4) as native:
        want = native_greedy(native, [32, 12])
    llm = ex.multi_node(llama4)
    try:
        assert llm.parallel_plan == (4, 2)
        assert f"token_ids={want}" in capsys.readouterr().out
    finally:
        llm.shutdown()


@needs_a_gpu_a_rank
def test_trtllm_checkpoint_through_the_facade(tmp_path, llama4, tp2_tokens):
    """A TP-sharded TensorRT-LLM checkpoint brings its tp_size, as in TensorRT-LLM; tokens as the HF original."""
    from trtllm_checkpoint import write_trtllm_checkpoint

    ckpt = str(tmp_path / "ckpt")
    write_trtllm_checkpoint(llama4, ckpt, tp_size=2)
    want = tp2_tokens
    config = ModelConfig(model_dir=ckpt)
    assert config.model_format == "trtllm-checkpoint" and config.parallel_config.tp_size == 2
    llm = LLM(config, tokenizer=llama4)
    try:
        assert llm.generate([[32, 12]])[0].token_ids == want
        llm.save(str(tmp_path / "saved"))  # the tokenizer given comes along: the checkpoint has none
    finally:
        llm.shutdown()
    saved = LLM(ModelConfig(model_dir=str(tmp_path / "saved")))  # on the 2 ranks it was saved with, as an engine
    try:
        assert saved.parallel_plan == (2, 1) and saved.generate([[32, 12]])[0].token_ids == want
        assert saved.generate("Hello")[0].text
    finally:
        saved.shutdown()


def test_streaming_llm_maps_onto_the_native_window(llama_dir):
    prompt = random_prompts(1, 6, 6, 1000, seed=3)[0]
    with NativeLLM(llama_dir, attention_window=16, sink_tokens=4) as native:
        want = native.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(ModelConfig(model_dir=llama_dir), streaming_llm=StreamingLLMParam(16, 4))
    try:
        assert llm.client.model_info.attention_window == 16
        sc = SamplingConfig(max_new_tokens=64)
        assert llm.generate([prompt], sc)[0].token_ids == want
    finally:
        llm.shutdown()


# ----- bad input -----

def test_bad_input_is_refused_clearly(tmp_path, llama, basic):
    with pytest.raises(ValueError, match="quant_algo='W3A16' is not supported on ember: use one of "
                                         "QuantAlgo.W8A16, QuantAlgo.W4A16, QuantAlgo.W4A16_AWQ"):
        config = ModelConfig(model_dir=llama)
        config.quant_config.quant_algo = "W3A16"
        LLM(config)
    with pytest.raises(ValueError, match="kv_cache_quant_algo=.*FP8.* use one of QuantAlgo.INT8"):
        config = ModelConfig(model_dir=llama)
        config.quant_config.kv_cache_quant_algo = QuantAlgo.FP8
        LLM(config)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="none of the formats ember reads: pass a Hugging Face model folder, a "
                                         "TensorRT-LLM checkpoint folder"):
        ModelConfig(model_dir=str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig(model_dir=str(tmp_path / "nope"))
    # a trtllm-build engine folder (TensorRT-LLM 0.10's config.json): its weights are TensorRT plans; the error
    # names the checkpoint it was built from and the build limits to set again
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({
        "version": "0.10.0",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "float16",
                              "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
                              "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None}},
        "build_config": {"max_batch_size": 8, "max_input_len": 1024, "max_output_len": 512, "max_num_tokens": 4096,
                         "max_beam_width": 1}}))
    for r in range(2):
        (engine / f"rank{r}.engine").write_bytes(b"\0")
    with pytest.raises(ValueError) as e:
        ModelConfig(model_dir=str(engine))
    for part in ("engine built by trtllm-build (TensorRT-LLM 0.10.0)", "rank0.engine, rank1.engine",
                 "cannot be recovered", "config.json + rank0.safetensors .. rank1.safetensors",
                 "architecture='LlamaForCausalLM', dtype='float16', tp_size=2, pp_size=1, quant_algo='W4A16_AWQ'",
                 "built for max_batch_size=8, max_input_len=1024, max_output_len=512, max_num_tokens=4096, "
                 "max_beam_width=1: set them on the ModelConfig with config._set_additional_options("):
        assert part in str(e.value)
    with pytest.raises(ValueError, match=r"beam_width=2 is out of range.*max_beam_width=1"):
        basic.generate(PROMPT, sampling_config=_beams(basic, 2))
    with pytest.raises(AttributeError, match="no field 'beam_size'"):
        basic.get_default_sampling_config().beam_size = 2
    sc = basic.get_default_sampling_config()
    sc.top_p_decay = 0.5
    with pytest.raises(ValueError, match="top_p_decay=0.5 is not supported"):
        basic.generate(PROMPT, sampling_config=sc)
    sc = basic.get_default_sampling_config()
    sc.temperature, sc.top_k = float("nan"), 5
    with pytest.raises(ValueError, match="temperature=nan"):
        basic.generate(PROMPT, sampling_config=sc)
    with pytest.raises(ValueError, match="world_size=2 is only read with auto_parallel"):
        config = ModelConfig(model_dir=llama)
        config.parallel_config.world_size = 2
        LLM(config)
    with pytest.raises(ValueError, match="Unknown options"):
        LLM(ModelConfig(model_dir=llama), no_such_option=1)
    assert len(basic.generate(PROMPT)[0].token_ids) == DEFAULT_NEW  # still serving
