"""The DashInfer (allspark) facade: the reference's two examples run unchanged and give the native API's tokens;
the serialized format round-trips; every status transition and wrong-state call; threads; release frees all."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import runpy
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from conftest import TESTS
from internals import worker_of

from ember import LLM, SamplingParams
from ember.compat.dashinfer import allspark
from ember.compat.dashinfer.allspark import (AsCacheMode, AsException, AsStatus, ASGenerationConfigBuilder,
                                             AsModelRuntimeConfigBuilder, DashInferModel, GenerateRequestStatus as S,
                                             HuggingFaceModel, ModelState, TargetDevice)
from ember.compat.dashinfer.allspark.engine import engine_config
from ember.config import default_model_path
from ember.model_loader import asmodel

SCRIPTS = os.path.join(TESTS, "compat_scripts")


def _run_script(name: str, tmp_path, monkeypatch, capsys) -> dict:
    """Run a reference script in this process (cwd: tmp_path) and return the JSON of its last line."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    runpy.run_path(os.path.join(SCRIPTS, name), run_name="__main__")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ----- the reference's examples, on the default model -----

QUICK_START_LENGTH = 512  # the quick start's max_length here (see below)


def test_quick_start_example_runs_unchanged_and_matches_native(tmp_path, monkeypatch, capsys):
    # The quick start's max_length(2048) makes its float16 engine warm up on 2,048-token prefills and its greedy
    # reply run to about 2,000 tokens: over three minutes on 2 cores without fast fp16. The runtime builder takes
    # QUICK_START_LENGTH instead here; the script runs unchanged otherwise, to that length.
    set_length = AsModelRuntimeConfigBuilder.max_length

    def shorter(self, length):  # the builder's own default (the model's context) comes through here too
        return set_length(self, min(int(length), QUICK_START_LENGTH))

    monkeypatch.setattr(AsModelRuntimeConfigBuilder, "max_length", shorter)
    out = _run_script("dashinfer_quick_start.py", tmp_path, monkeypatch, capsys)
    assert len(out["ids"]) > 10
    model_path = os.path.join(tmp_path, out["model_path"])
    assert asmodel.validate(model_path) is None  # serialize(model_output_dir=...) wrote a valid pair
    assert asmodel.read_meta(model_path)["dtype"] == "float16"  # user_set_data_type
    # the native API on the same serialized model, greedy (top_k=1): greedy tokens do not depend on how many follow,
    # so the first 256 are compared; prefilled in chunks of 64 tokens (a chunked prompt gets the same tokens), so the
    # warm-up prefills 64 fp16 tokens instead of 512
    with LLM(model_path, max_num_seqs=1, max_model_len=QUICK_START_LENGTH, max_num_batched_tokens=64) as llm:
        prompt = llm.tokenizer.encode(out["prompt"])
        native = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=256),
                              use_tqdm=False)[0].outputs[0].token_ids
        eos = llm.client.eos_token_ids
    assert out["ids"][:256] == native
    # ... and it ran to the end: max_length (prompt + output) or an EOS
    assert len(prompt) + len(out["ids"]) == QUICK_START_LENGTH or out["ids"][-1] in eos


SNIPPET_CONTEXT = 512  # the model's context as the snippet's loader reports it, for this test (see below)


def test_simple_snippet_runs_unchanged_and_matches_native(tmp_path, monkeypatch, capsys):
    random.seed(3)  # the builder draws its default seed from `random`, as DashInfer's does: fix it to compare
    # The snippet's runtime config takes the model's context (8,192 for SmolLM2) as max_length, and its sampled reply
    # runs to it: 8,190 bf16 tokens, about 27 minutes on 2 cores without fast bf16. The loader reports a context of
    # SNIPPET_CONTEXT tokens here instead; the snippet runs unchanged, to that length.
    monkeypatch.setattr(HuggingFaceModel, "get_model_context_length", lambda self: SNIPPET_CONTEXT)
    out = _run_script("dashinfer_simple_snippet.py", tmp_path, monkeypatch, capsys)
    gen = out["gen_cfg"]
    assert gen["top_k"] == 50 and gen["do_sample"] and out["max_length"] == SNIPPET_CONTEXT  # transformers' defaults
    assert len(out["ids"]) > 5
    # the native API on the GGUF itself (bfloat16 float weights both ways: the serialization had no enable_quant;
    # explicit, since dtype "auto" is float32 on a CPU without fast bf16), same sampling and seed. A seeded request
    # draws its tokens one per step from its own generator, so they do not depend on how many follow: the first 256
    # are compared (the snippet's reply runs to max_length)
    with LLM(default_model_path(), max_num_seqs=1, max_model_len=SNIPPET_CONTEXT, max_num_batched_tokens=64,
             quantization="none", dtype="bfloat16") as llm:
        prompt = llm.tokenizer.encode("who are you?")
        params = SamplingParams(temperature=1.0, top_k=50, top_p=1.0, seed=gen["seed"], max_tokens=256)
        native = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        eos = llm.client.eos_token_ids
    assert out["ids"][:256] == native
    assert len(prompt) + len(out["ids"]) == SNIPPET_CONTEXT or out["ids"][-1] in eos  # ... and it ran to the end


# ----- a tiny random model for the rest -----

@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    """A tiny Llama serialized (float32) to a folder, and the native engine's greedy tokens to compare with."""
    out = str(tmp_path_factory.mktemp("asmodel"))
    loader = HuggingFaceModel(tiny_models["llama"], "tiny/llama", user_set_data_type="float32")
    loader.load_model().serialize_to_path(None, out).free_model()
    return {"src": tiny_models["llama"], "dir": out, "name": "tiny_llama", "loader": loader,
            "model_path": os.path.join(out, "tiny_llama.asmodel")}


@pytest.fixture(scope="module")
def native_greedy(tiny):
    llm = LLM(tiny["src"], dtype="float32", max_num_seqs=32, kv_cache_memory="64MiB")

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    yield run
    llm.shutdown()


def _runtime(loader, name: str, max_batch: int = 32, max_length: int = 256):
    return loader.create_reference_runtime_config_builder(name, TargetDevice.CPU, [0], max_batch=max_batch) \
        .max_length(max_length).build()


def _greedy(loader, runtime_cfg, max_new: int, **extra) -> ASGenerationConfigBuilder:
    gen = loader.create_reference_generation_config_builder(runtime_cfg)
    gen.update({"top_k": 1, "early_stopping": False, **extra})
    gen["max_length"] = max_new  # replaced per request below when a prompt length is known
    return gen


def _ids_of(queue) -> list[int]:
    ids = []
    while True:
        el = queue.Get()
        if el is not None:
            ids += el.ids_from_generate
        if queue.GenerateStatus() in (S.GenerateFinished, S.GenerateInterrupted, S.InternalError):
            return ids


@pytest.fixture
def running(tiny):
    """An engine with the serialized tiny model installed and started; stopped afterwards if still running."""
    engine = allspark.Engine()
    loader = DashInferModel(tiny["dir"], tiny["name"])
    cfg = _runtime(loader, "m")
    engine.install_model(cfg)
    engine.start_model("m")
    yield engine, loader, cfg
    if engine.get_model_state("m") is ModelState.Running:
        engine.stop_model("m")


def test_serialize_to_path_then_dashinfer_model_same_greedy_tokens(tiny, native_greedy, running):
    engine, loader, cfg = running
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(3)]
    expected = native_greedy(prompts, 12)
    for prompt, want in zip(prompts, expected):
        gen = _greedy(loader, cfg, 0)
        gen["max_length"] = len(prompt) + 12
        status, handle, queue = engine.start_request_ids("m", loader, prompt, gen)
        assert status is AsStatus.ALLSPARK_SUCCESS
        assert _ids_of(queue) == want
        engine.release_request("m", handle)
    # ... and natively from the .asmodel file
    with LLM(tiny["model_path"], max_num_seqs=4, kv_cache_memory="16MiB") as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_asmodel_format_contents(tiny):
    meta = asmodel.read_meta(tiny["model_path"])
    assert meta["format"] == "ember.asmodel" and meta["architecture"] == "LlamaForCausalLM"
    assert meta["dtype"] == "float32" and meta["config"]["model_type"] == "llama"
    assert "tokenizer.json" in meta["tokenizer"] and meta["chat_template"]
    recipe = meta["extra"]["dashinfer"]["serialize"]  # the facade's flags, kept in the pair's "extra"
    assert recipe == {"enable_quant": False, "weight_only_quant": False, "customized_quant_config": None}
    from safetensors import safe_open

    with safe_open(os.path.join(tiny["dir"], "tiny_llama.asparam"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(meta["weights"]["tensors"])
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())


def test_skip_if_exists_and_validation(tiny, tmp_path):
    loader = HuggingFaceModel(tiny["src"], "m", user_set_data_type="float32")
    loader.serialize_to_path(None, str(tmp_path), enable_quant=True, weight_only_quant=True,
                             customized_quant_config={"quant_method": "instant_quant", "weight_format": "int8"})
    model_path, param_path = asmodel.pair_paths(str(tmp_path), "m")
    meta = asmodel.read_meta(model_path)
    recipe = meta["extra"]["dashinfer"]["serialize"]
    assert recipe["enable_quant"] and recipe["customized_quant_config"]["weight_format"]
    stamp = os.stat(param_path).st_mtime_ns
    loader.serialize_to_path(None, str(tmp_path), skip_if_exists=True)
    assert os.stat(param_path).st_mtime_ns == stamp  # kept
    with open(param_path, "r+b") as f:  # truncate the weights: the pair no longer validates
        f.truncate(os.path.getsize(param_path) - 100)
    assert "truncated" in asmodel.validate(model_path)
    with pytest.raises(ValueError, match="cannot be used"):
        DashInferModel(str(tmp_path), "m")
    loader.serialize_to_path(None, str(tmp_path), skip_if_exists=True)  # rewritten, since it was broken
    assert asmodel.validate(model_path) is None and os.stat(param_path).st_mtime_ns != stamp


def test_in_memory_files_removed_by_free_and_after_install(tiny, native_greedy):
    """The guide: the temporary files go with free_model() (or at exit). Its snippet frees the model before it
    installs it, so the engine given to serialize_to_memory keeps them until start_model has loaded them."""
    engine = allspark.Engine()
    loader = HuggingFaceModel(tiny["src"], "mem", in_memory_serialize=True, user_set_data_type="float32")
    loader.load_model().serialize(engine).free_model()
    folder = os.path.dirname(loader.model_path)
    assert loader.temp_folder is None and os.path.isfile(os.path.join(folder, "mem.asmodel"))  # held by the engine
    cfg = _runtime(loader, "mem")
    engine.install_model(cfg)
    assert os.path.isdir(folder)  # ... until the model has loaded them
    engine.start_model("mem")
    assert not os.path.exists(folder)
    alone = HuggingFaceModel(tiny["src"], "alone", in_memory_serialize=True, user_set_data_type="float32")
    alone.load_model().serialize_to_memory(None)
    kept = alone.temp_folder
    engine2 = allspark.Engine()
    engine2.install_model(_runtime(alone, "alone"))
    alone.free_memory_serialize_file()  # right after install_model: the files wait for start_model too
    assert os.path.isdir(kept)
    engine2.release_model("alone")  # released without loading: nothing waits for them any more
    assert not os.path.exists(kept)
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 4 + 8
    _, _, q = engine.start_request_ids("mem", loader, [5, 6, 7, 8], gen)
    assert _ids_of(q) == native_greedy([[5, 6, 7, 8]], 8)[0]
    engine.stop_model("mem")


def test_in_memory_loader_dropped_after_install_keeps_the_files(tiny):
    import gc

    engine = allspark.Engine()
    loader = HuggingFaceModel(tiny["src"], "dropped", in_memory_serialize=True, user_set_data_type="float32")
    engine.install_model(_runtime(loader.serialize(None), "dropped"))
    folder = loader.temp_folder
    del loader
    gc.collect()
    engine.start_model("dropped")  # the files outlive the loader (they go at exit, or with free)
    assert os.path.isdir(folder)
    engine.stop_model("dropped")


def test_in_memory_files_removed_at_process_exit(tiny):
    code = ("import sys\nfrom ember.compat.dashinfer.allspark import HuggingFaceModel\n"
            f"m = HuggingFaceModel({tiny['src']!r}, 'x', in_memory_serialize=True)\n"
            "m.load_model().serialize_to_memory(None)\nprint(m.temp_folder)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    folder = out.stdout.strip().splitlines()[-1]
    assert folder and not os.path.exists(folder)


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="pretrain_model_name_or_path"):
        HuggingFaceModel(str(tmp_path / "missing"), "x")
    with pytest.raises(ValueError, match="pretrain_model_name_or_path"):
        HuggingFaceModel("", "x")
    with pytest.raises(ValueError, match="not a model"):
        HuggingFaceModel(str(tmp_path), "x")  # an empty folder
    with pytest.raises(ValueError, match="user_set_data_type"):
        HuggingFaceModel(default_model_path(), "x", user_set_data_type="int3")
    with pytest.raises(ValueError, match="cannot be used"):
        DashInferModel(str(tmp_path), "nothing")


# ----- life cycle and wrong-state calls -----

def test_model_states_and_wrong_state_calls(tiny, caplog):
    """As DashInfer's engine calls do, a wrong state, an unknown model or an unknown handle comes back as an
    AsStatus (the reason logged); a request that cannot start returns (status, None, None)."""
    A = AsStatus
    engine = allspark.Engine()
    loader = DashInferModel(tiny["model_path"])
    cfg = _runtime(loader, "a")
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 12
    assert engine.start_model("a") is A.ALLSPARK_PARAM_ERROR
    assert "model 'a' is not installed" in caplog.text
    assert engine.install_model(cfg) is A.ALLSPARK_SUCCESS
    assert engine.get_model_state("a") is ModelState.Initial
    with pytest.raises(AsException, match="already installed"):  # DashInfer's install_model raises too
        engine.install_model(_runtime(loader, "a"))
    assert engine.start_request_ids("a", loader, [1, 2, 3], gen) == (A.ALLSPARK_REQUEST_DENIED, None, None)
    assert "model 'a' is Initial: this call needs it Running" in caplog.text
    assert engine.stop_model("a") is A.ALLSPARK_INVALID_CALL_ERROR
    assert A.ALLSPARK_ALLSPARK_INVALID_CALL_ERROR is A.ALLSPARK_INVALID_CALL_ERROR  # the binding's own name for it
    assert engine.start_model("a") is A.ALLSPARK_SUCCESS
    assert engine.get_model_state("a") is ModelState.Running
    assert engine.start_model("a") is A.ALLSPARK_INVALID_CALL_ERROR
    assert engine.release_model("a") is A.ALLSPARK_INVALID_CALL_ERROR
    assert engine.start_request_ids("b", loader, [1, 2, 3], gen) == (A.ALLSPARK_PARAM_ERROR, None, None)
    _, handle, q = engine.start_request_ids("a", loader, [1, 2, 3], gen)
    engine.sync_request("a", handle)
    assert engine.stop_model("a") is A.ALLSPARK_SUCCESS
    assert engine.get_model_state("a") is ModelState.Stopped
    assert engine.start_request_ids("a", loader, [1, 2, 3], gen) == (A.ALLSPARK_REQUEST_DENIED, None, None)
    assert engine.stop_request("a", handle) is A.ALLSPARK_INVALID_CALL_ERROR
    assert engine.stop_model("a") is A.ALLSPARK_REQUEST_DENIED  # stopping twice
    assert q.Get() is not None  # a queue outlives its model's stop until released
    engine.start_model("a")  # Stopped -> Running again
    _, h2, q2 = engine.start_request_ids("a", loader, [1, 2, 3], gen)
    assert len(_ids_of(q2)) == 9
    assert engine.release_request("a", handle) is A.ALLSPARK_SUCCESS  # from before the restart: still held
    for call in (engine.release_request, engine.stop_request, engine.sync_request):  # released already
        assert call("a", handle) is A.ALLSPARK_ILLEGAL_REQUEST_ID
    assert "is not a live request of model 'a'" in caplog.text
    assert engine.stop_request("a", None) is engine.release_request("a", None) is A.ALLSPARK_EMPTY_REQUEST
    assert engine.stop_model("a") is A.ALLSPARK_SUCCESS
    assert engine.release_model("a") is A.ALLSPARK_SUCCESS
    assert engine.get_model_state("a") is ModelState.Released
    assert engine.start_model("a") is A.ALLSPARK_INVALID_CALL_ERROR
    with pytest.raises(AsException, match="not installed"):  # no status to return it in: it raises
        engine.get_model_state("zzz")
    engine.install_model(_runtime(loader, "a"))  # a released name may be installed again
    engine.release_model("a")


def test_requests_that_cannot_start_return_a_status(running, caplog):
    """DashInfer returns (status, None, None) for a request it will not start, the reason logged; a list of texts
    starts all or none; inputs of the wrong type raise, as DashInfer's binding does."""
    engine, loader, cfg = running
    A = AsStatus
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 300
    assert engine.start_request_ids("m", loader, list(range(1, 257)), gen) == (A.ALLSPARK_EXCEED_LIMIT_ERROR, None,
                                                                                None)
    assert "the prompt has 256 tokens: with the engine's max_length (256)" in caplog.text
    # DashInfer's code for an empty prompt too (input length <= 0)
    assert engine.start_request_ids("m", loader, [], gen) == (A.ALLSPARK_EXCEED_LIMIT_ERROR, None, None)
    assert engine.start_request_text("m", loader, "", gen) == (A.ALLSPARK_EXCEED_LIMIT_ERROR, None, None)
    for field, value, message in (("max_length", 3, "max_length=3 is out of range"),
                                  ("top_logprobs", 11, "top_logprobs=11 is out of range"),
                                  ("repetition_penalty", 2.5, "repetition_penalty=2.5 is out of range"),
                                  ("enable_tensors_from_model_inference", True, "tensors_from_model_inference"),
                                  ("length_penalty", 1.2, "length_penalty=1.2 is not supported"),
                                  ("temperature", float("nan"), "temperature=nan"),
                                  ("top_p", 2.0, "top_p=2.0"),
                                  ("response_format", {"type": "xml"}, "response_format=")):
        bad = {**_greedy(loader, cfg, 0).build(), "max_length": 20, field: value}  # a dict: the builder checks too
        assert engine.start_request_ids("m", loader, [1, 2, 3], bad) == (A.ALLSPARK_PARAM_ERROR, None, None), field
        assert message in caplog.text
    gen["max_length"] = 20
    status, handles, queues = engine.start_request_text("m", loader, ["fine", "x " * 300], gen)
    assert (status, handles, queues) == (A.ALLSPARK_EXCEED_LIMIT_ERROR, None, None)
    assert not engine._models["m"].queues  # the first text did not start either
    with pytest.raises(ValueError, match="input_ids"):
        engine.start_request_ids("m", loader, [[1, 2], [3, 4]], gen)
    with pytest.raises(ValueError, match="must be a string or a non-empty list of strings"):
        engine.start_request_text("m", loader, [5], gen)


def test_status_transitions(running):
    engine, loader, cfg = running
    gen = _greedy(loader, cfg, 0)
    prompt = [11, 12, 13, 14]
    gen["max_length"] = len(prompt) + 6
    _, h, q = engine.start_request_ids("m", loader, prompt, gen)
    assert q.GenerateStatus() in (S.Init, S.ContextFinished, S.Generating)
    assert len(_ids_of(q)) == 6 and q.GeneratedLength() == 6
    assert q.history == [S.Init, S.ContextFinished, S.Generating, S.GenerateFinished]
    assert q.Get() is None and q.GetNoWait() is None and q.GetWithTimeout(10) is None  # finished and drained
    stats = q.RequestStatInfo()
    assert stats["context_token_length"] == 4 and stats["generated_token_length"] == 6
    assert stats["time_to_first_token"] > 0 and stats["decode_time_ms"] >= 0 and "context_cached_length" in stats
    # one token: the first token is also the last
    gen["max_length"] = len(prompt) + 1
    _, _, q1 = engine.start_request_ids("m", loader, prompt, gen)
    engine.sync_request("m")
    assert q1.history == [S.Init, S.ContextFinished, S.GenerateFinished]
    # the terminal status shows only once the tokens are taken: the documented loop never drops any
    assert q1.GenerateStatus() is S.ContextFinished
    assert q1.Get().ids_from_generate and q1.GenerateStatus() is S.GenerateFinished


def test_stop_request_and_stop_model_interrupts(running):
    engine, loader, cfg = running
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 250
    _, h, q = engine.start_request_ids("m", loader, [1, 2, 3], gen)
    q.GetWithTimeout(10_000)  # it has started
    assert engine.stop_request("m", h) is AsStatus.ALLSPARK_SUCCESS
    assert q.history[-1] is S.GenerateFinished and q.GeneratedLength() < 247
    _, h2, q2 = engine.start_request_ids("m", loader, [1, 2, 3], gen)
    q2.GetWithTimeout(10_000)
    engine.stop_model("m")
    assert q2.history[-1] is S.GenerateInterrupted
    _ids_of(q2)
    assert q2.GenerateStatus() is S.GenerateInterrupted


def test_internal_error_status(running):
    engine, loader, cfg = running
    native = engine._models["m"].engine

    def broken(*a, **k):
        raise RuntimeError("injected failure")

    worker_of(native).execute_model = broken
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 10
    _, h, q = engine.start_request_ids("m", loader, [1, 2, 3], gen)
    assert q.Get() is None and q.GenerateStatus() is S.InternalError


def test_sync_request_then_get_returns_everything(running, native_greedy):
    engine, loader, cfg = running
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 3 + 20
    _, h, q = engine.start_request_ids("m", loader, torch.tensor([[7, 8, 9]]), gen)
    assert engine.sync_request("m", h) is AsStatus.ALLSPARK_SUCCESS
    el = q.Get()
    assert el.ids_from_generate == native_greedy([[7, 8, 9]], 20)[0]
    assert q.Get() is None
    engine.release_request("m", h)
    assert q.Get() is None


def test_twenty_requests_polled_from_threads_then_released(running, native_greedy):
    engine, loader, cfg = running
    prompts = [[50 + i, 60 + 2 * i, 70 + 3 * i] for i in range(20)]
    expected = native_greedy(prompts, 16)
    results: dict[int, list[int]] = {}
    handles = {}
    errors = []

    def worker(i: int) -> None:
        try:
            gen = _greedy(loader, cfg, 0)
            gen["max_length"] = len(prompts[i]) + 16
            _, handles[i], q = engine.start_request_ids("m", loader, prompts[i], gen)
            ids = []
            while q.GenerateStatus() not in (S.GenerateFinished, S.GenerateInterrupted):
                el = q.GetWithTimeout(50) if i % 2 else q.GetNoWait()
                if el is not None:
                    ids += el.ids_from_generate
                # the GetNoWait pollers spin without sleeping, as DashInfer users do: the queue must not starve the
                # engine thread of the GIL
            results[i] = ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [results[i] for i in range(20)] == expected
    for h in handles.values():
        engine.release_request("m", h)
    stats = engine.get_as_engine_stat("m")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == stats["waiting"] == 0
    assert not engine._models["m"].queues


# ----- generation config -----

def test_generation_config_keys_and_translation(running):
    engine, loader, cfg = running
    gen = loader.create_reference_generation_config_builder(cfg)
    assert gen["max_length"] == 256 and gen["top_k"] == 50 and gen["do_sample"] is True
    with pytest.raises(ValueError, match="'top_q' is unknown"):
        gen.update({"top_q": 0.5})
    with pytest.raises(ValueError, match="mm_info of type object is not supported"):
        gen.update({"mm_info": object()})
    with pytest.raises(ValueError, match="lora_name=5 is out of range"):
        gen.update({"lora_name": 5})
    gen.update({"max_length": 8, "temperature": -1.0, "top_k": 5})
    assert engine.start_request_ids("m", loader, [1, 2, 3], gen)[0] is AsStatus.ALLSPARK_PARAM_ERROR
    built = ASGenerationConfigBuilder().do_sample().max_length(512).temperature(0.7).top_k(50).build()
    assert built["max_length"] == 512 and built["temperature"] == 0.7 and built["top_k"] == 50


def test_response_format_every_guided_form(running, tiny):
    """DashInfer's guided decoding: response_format json_object (with a schema or without), json_schema (also in
    OpenAI's wrapper), regex, choice and grammar; bad ones return ALLSPARK_PARAM_ERROR before anything starts."""
    import jsonschema
    from transformers import AutoTokenizer

    engine, loader, cfg = running
    tok = AutoTokenizer.from_pretrained(tiny["src"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}

    def follows_schema(text):
        jsonschema.validate(json.loads(text), schema)

    cases = (({"type": "json_object", "json_schema": json.dumps(schema)}, follows_schema),
             ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
             ({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}, follows_schema),
             ({"type": "json_schema", "json_schema": schema}, follows_schema),
             ({"type": "regex", "regex": "[a-c]{3}-[0-9]{2}"},
              lambda text: re.fullmatch("[a-c]{3}-[0-9]{2}", text) or pytest.fail(text)),
             ({"type": "choice", "choice": ["red", "green", "blue"]},
              lambda text: text in ("red", "green", "blue") or pytest.fail(text)),
             ({"type": "grammar", "grammar": 'start: "yes" | "no"'},
              lambda text: text in ("yes", "no") or pytest.fail(text)))
    for fmt, check in cases:
        gen = loader.create_reference_generation_config_builder(cfg)
        gen.update({"top_k": 1, "max_length": 200, "response_format": fmt})
        status, h, q = engine.start_request_ids("m", loader, [7, 8, 9], gen)
        assert status is AsStatus.ALLSPARK_SUCCESS, fmt
        ids = _ids_of(q)
        engine.release_request("m", h)
        check(tok.decode(ids, skip_special_tokens=True))
    gen = loader.create_reference_generation_config_builder(cfg)
    for fmt in ({"type": "json_schema"}, {"type": "json_object", "json_schema": "{oops"}, {"type": "xml"},
                {"type": "regex", "regex": "[a-"}, {"type": "regex", "regex": "a", "extra": 1},
                {"type": "choice", "choice": []}):
        gen.update({"response_format": fmt})
        assert engine.start_request_ids("m", loader, [1, 2, 3], gen) == (AsStatus.ALLSPARK_PARAM_ERROR, None, None)


def test_generation_defaults_from_the_models_generation_config(tiny, tmp_path):
    import shutil

    src = str(tmp_path / "src")
    shutil.copytree(tiny["src"], src)
    with open(os.path.join(src, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "eos_token_id": [2, 5]}, f)
    loader = HuggingFaceModel(src, "g")
    gen = loader.create_reference_generation_config_builder()
    assert (gen["temperature"], gen["top_p"], gen["top_k"], gen["repetition_penalty"]) == (0.6, 0.9, 20, 1.1)
    assert gen["eos_token_id"] == 2 and gen["stop_words_ids"] == [[2], [5]]  # DashInfer's reading of an EOS list
    loader.serialize_to_path(None, str(tmp_path / "out"))
    gen2 = DashInferModel(str(tmp_path / "out"), "g").create_reference_generation_config_builder()
    assert (gen2["temperature"], gen2["top_p"], gen2["top_k"]) == (0.6, 0.9, 20)  # carried in the .asmodel


def test_fields_translate_to_native_sampling(running, tiny):
    """stop_words_ids, bad_words_ids, min_length, no_repeat_ngram_size, suppress_repetition_in_generation,
    logprobs and seeded sampling through the facade equal the native fields on the same model; length_penalty
    (it scores beams, and there are none) is refused."""
    engine, loader, cfg = running
    prompt = [21, 22, 23, 24, 25]
    free = None
    with LLM(tiny["model_path"], max_num_seqs=4, kv_cache_memory="16MiB") as llm:
        def native(**kw):
            out = llm.generate([prompt], SamplingParams(max_tokens=20, **kw), use_tqdm=False)[0].outputs[0]
            return out

        free = native(temperature=0, ignore_eos=True).token_ids
        cases = [
            ({"stop_words_ids": [free[3:5]]}, dict(temperature=0, ignore_eos=True, stop_token_sequences=[free[3:5]])),
            ({"bad_words_ids": [[free[0]]]}, dict(temperature=0, ignore_eos=True, bad_words_ids=[[free[0]]])),
            ({"no_repeat_ngram_size": 1}, dict(temperature=0, ignore_eos=True, no_repeat_ngram_size=1)),
            # the guide: suppress_repetition_in_generation=True suppresses with presence_penalty, False with
            # repetition_penalty; the other has no effect
            ({"presence_penalty": 1.5, "repetition_penalty": 1.3, "suppress_repetition_in_generation": True},
             dict(temperature=0, ignore_eos=True, presence_penalty=1.5)),
            ({"presence_penalty": 1.5, "repetition_penalty": 1.3},
             dict(temperature=0, ignore_eos=True, repetition_penalty=1.3)),
            ({"top_k": 20, "temperature": 0.8, "top_p": 0.9, "seed": 1234},
             dict(temperature=0.8, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)),
            ({"early_stopping": True, "eos_token_id": free[2], "min_length": len(prompt) + 4},
             dict(temperature=0, eos_token_ids=(free[2],), min_tokens=4)),
            ({"logprobs": True, "top_logprobs": 3}, dict(temperature=0, ignore_eos=True, logprobs=3)),
        ]
        for facade_fields, native_fields in cases:
            want = native(**native_fields)
            gen = _greedy(loader, cfg, 0, **facade_fields)
            gen["max_length"] = len(prompt) + 20
            _, h, q = engine.start_request_ids("m", loader, prompt, gen)
            engine.sync_request("m", h)
            el = q.Get()
            assert el.ids_from_generate == want.token_ids, facade_fields
            if "logprobs" in facade_fields:
                assert len(el.log_probs_list) == len(want.token_ids) and all(len(p) == 3 for p in el.log_probs_list)
                for pos, top, lp in zip(want.logprobs, el.log_probs_list, el.token_logprobs_list):
                    ranked = sorted((v.rank, k, v.logprob) for k, v in pos.items() if v.rank <= 3)
                    # same engine, same tokens: equal up to the device's reduction order (on CUDA the kernels
                    # differ with the batch's rows: 1.1e-5 apart on an H100)
                    assert [k for k, _ in top] == [k for _, k, _ in ranked]
                    assert [v for _, v in top] == pytest.approx([v for _, _, v in ranked], abs=1e-4)
                    assert lp == pytest.approx(next(iter(pos.values())).logprob, abs=1e-4)
            engine.release_request("m", h)
    gen = _greedy(loader, cfg, 0, length_penalty=1.2)
    gen["max_length"] = len(prompt) + 20
    assert engine.start_request_ids("m", loader, prompt, gen) == (AsStatus.ALLSPARK_PARAM_ERROR, None, None)


def test_start_request_text_list_and_model_loader_tokenizer(running):
    engine, loader, cfg = running
    gen = _greedy(loader, cfg, 0)
    gen["max_length"] = 40
    status, handles, queues = engine.start_request_text("m", loader.init_tokenizer(), ["hello there", "a b c"], gen)
    assert status is AsStatus.ALLSPARK_SUCCESS and len(handles) == len(queues) == 2
    tok = loader.get_tokenizer()
    for text, q in zip(["hello there", "a b c"], queues):
        engine.sync_request("m")
        assert len(q.Get().ids_from_generate) == 40 - len(tok.encode(text))


# ----- engines, devices, memory -----

def test_two_models_in_one_engine(tiny, tiny_models, tmp_path):
    engine = allspark.Engine()
    a = DashInferModel(tiny["model_path"])
    b = HuggingFaceModel(tiny_models["qwen2"], "qwen", user_set_data_type="float32")
    b.load_model().serialize_to_path(None, str(tmp_path)).free_model()
    for name, loader in (("llama", a), ("qwen", b)):
        engine.install_model(_runtime(loader, name, max_batch=4))
        engine.start_model(name)
    prompt = [31, 32, 33]
    got = {}
    for name, loader in (("llama", a), ("qwen", b)):
        gen = _greedy(loader, _runtime(loader, name), 0)
        gen["max_length"] = 3 + 10
        _, h, q = engine.start_request_ids(name, loader, prompt, gen)
        got[name] = _ids_of(q)
    for name, src in (("llama", tiny["src"]), ("qwen", tiny_models["qwen2"])):
        with LLM(src, dtype="float32", max_num_seqs=2, kv_cache_memory="16MiB") as llm:
            want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
        assert got[name] == want
        engine.stop_model(name)


def test_start_model_that_cannot_fit_fails_clearly(tiny, monkeypatch):
    monkeypatch.setenv("BFC_MEM_RATIO", "0.000001")  # DashInfer's knob, read by ember
    monkeypatch.delenv("EMBER_MEM_RATIO", raising=False)
    engine = allspark.Engine()
    loader = DashInferModel(tiny["model_path"])
    engine.install_model(_runtime(loader, "big", max_batch=64, max_length=512))
    with pytest.raises(ValueError, match="start_model\\('big'\\) failed: .*max_model_len"):
        engine.start_model("big")
    assert engine.get_model_state("big") is ModelState.Initial


def test_runtime_builder_checks_and_unsupported_modes(tiny, caplog):
    b = AsModelRuntimeConfigBuilder()
    with pytest.raises(ValueError, match="max_batch"):
        b.max_batch(0)
    with pytest.raises(ValueError, match="kv_cache_span_size"):
        b.kv_cache_span_size(24)
    with pytest.raises(ValueError, match="target_device"):
        b.compute_unit("TPU")
    loader = DashInferModel(tiny["model_path"])
    cfg = loader.create_reference_runtime_config_builder("q", TargetDevice.CPU, [0], max_batch=2) \
        .kv_cache_mode(AsCacheMode.AsCacheQuantI8).build()
    assert engine_config(cfg).kv_cache_dtype == "int8"  # the KV modes are ember's kv_cache_dtype
    cfg = AsModelRuntimeConfigBuilder().from_dict({
        "model_name": "d", "compute_unit": {"device_type": "CUDA", "device_ids": [0], "compute_thread_in_device": 0},
        "engine_max_length": 128, "engine_max_batch": 2, "kv_cache_span_size": 32, "enable_prefix_cache": False,
    }).model_file_path(tiny["model_path"], tiny["model_path"][:-8] + ".asparam").build()
    assert (cfg.engine_max_length, cfg.cache_span_size, cfg.enable_prefix_cache) == (128, 32, False)
    ratio = AsModelRuntimeConfigBuilder().from_dict({
        "model_name": "r", "compute_unit": {"device_type": "CPU", "device_ids": [0]}, "engine_max_length": 64,
        "engine_max_batch": 1, "cuda_mem": {"memory_ratio": 0.25}}).model_file_path(
        tiny["model_path"], tiny["model_path"][:-8] + ".asparam").build()
    before = dict(os.environ)
    assert engine_config(ratio).kv_cache_memory_fraction == 0.25  # the model's own setting ...
    assert dict(os.environ) == before  # ... not a global
    with caplog.at_level(logging.INFO, logger="ember"):
        engine = allspark.Engine()
    assert "AllSpark Init with Version: ember" in caplog.text  # DashInfer logs its version when an engine is made
    engine.install_model(cfg)
    engine.start_model("d")
    if not torch.cuda.is_available():
        assert "no CUDA device is available; running on CPU" in caplog.text
    stats = engine.get_as_engine_stat("d")
    assert stats["kv_blocks_total"] > 0
    engine.stop_model("d")


def test_memory_ratio_default_and_cpu_numa(tiny, monkeypatch, caplog):
    """BFC_MEM_RATIO: the guide's default 0.975 of a CUDA device (its allocator is CUDA's; on CPU ember's default
    holds), the variable when set (checked); CPU_NUMA says what it does with its node ids."""
    import ember.compat.dashinfer.allspark.engine as as_engine

    loader = DashInferModel(tiny["model_path"])
    cuda = loader.create_reference_runtime_config_builder("c", TargetDevice.CUDA, [0], max_batch=2).build()
    cpu = loader.create_reference_runtime_config_builder("p", TargetDevice.CPU, [0], max_batch=2).build()
    monkeypatch.delenv("EMBER_MEM_RATIO", raising=False)
    monkeypatch.delenv("BFC_MEM_RATIO", raising=False)
    monkeypatch.setattr(as_engine.torch.cuda, "is_available", lambda: True)  # the mapping only: nothing starts
    assert (engine_config(cuda).device, engine_config(cuda).kv_cache_memory_fraction) == ("cuda:0", 0.975)
    monkeypatch.setenv("BFC_MEM_RATIO", "0.5")
    assert engine_config(cuda).kv_cache_memory_fraction == 0.5
    monkeypatch.setenv("BFC_MEM_RATIO", "1.5")
    with pytest.raises(ValueError, match="BFC_MEM_RATIO"):
        engine_config(cuda)
    monkeypatch.delenv("BFC_MEM_RATIO")
    assert engine_config(cpu).kv_cache_memory_fraction is None  # ember's CPU default
    numa = loader.create_reference_runtime_config_builder("n", TargetDevice.CPU_NUMA, [0, 1], max_batch=2) \
        .build()
    numa.num_threads = 8
    assert engine_config(numa).device == "cpu"
    assert "CPU_NUMA with NUMA nodes [0, 1] runs as one CPU engine of 8 threads, not bound" in caplog.text


# ----- LoRA: DashInfer's flow (serialize with lora_cfg, load_lora, lora_name, unload_lora) -----

def test_lora_adapters_as_dashinfer_serves_them(tiny_models, tmp_path):
    """Two PEFT adapters (one in PEFT's older .bin form) serialized with lora_cfg into NAME.aslora beside the model,
    loaded with load_lora and named per request with lora_name: each request's tokens equal transformers + peft;
    the status codes say not found, already loaded, too many, in use, as DashInfer's do."""
    from conftest import peft_adapter, peft_greedy, random_prompts
    from safetensors.torch import load_file

    src = tiny_models["llama"]
    loras = tmp_path / "loras"
    peft_adapter(src, str(loras / "lora-1"), seed=1, r=8)
    peft_adapter(src, str(loras / "lora-2"), seed=2, r=4, target_modules=["q_proj", "v_proj", "up_proj"])
    old = loras / "lora-2"  # PEFT's older format: the weights as adapter_model.bin
    torch.save(load_file(old / "adapter_model.safetensors"), old / "adapter_model.bin")
    (old / "adapter_model.safetensors").unlink()
    out = tmp_path / "out"
    loader = HuggingFaceModel(src, "tiny", user_set_data_type="float32")
    loader.load_model().serialize_to_path(None, str(out), lora_cfg={"input_base_dir": str(loras),
                                                                    "lora_names": ["lora-1", "lora-2"]})
    assert sorted(os.listdir(out)) == ["lora-1.aslora", "lora-2.aslora", "tiny.asmodel", "tiny.asparam"]
    prompts = random_prompts(3, 8, 20, 49152, seed=71)
    engine = allspark.Engine()
    cfg = loader.create_reference_runtime_config_builder("m", TargetDevice.CPU, [0], max_batch=8) \
        .max_length(128).lora_max_num(2).lora_max_rank(8).build()
    engine.install_model(cfg)
    engine.start_model("m")

    def start(prompt: list[int], name: str | None, new_tokens: int = 8):
        gen = _greedy(loader, cfg, new_tokens, lora_name=name)
        gen["max_length"] = len(prompt) + new_tokens
        return engine.start_request_ids("m", loader, prompt, gen)

    try:
        assert start(prompts[0], "lora-1")[0] == AsStatus.ALLSPARK_LORA_NOT_FOUND  # not loaded yet
        assert engine.unload_lora("m", "lora-1") == AsStatus.ALLSPARK_LORA_NOT_FOUND
        assert engine.load_lora("m", "lora-3") == AsStatus.ALLSPARK_LORA_NOT_FOUND  # no lora-3.aslora
        for name in ("lora-1", "lora-2"):
            assert engine.load_lora("m", name) == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", "lora-1") == AsStatus.ALLSPARK_LORA_ALREADY_LOADED
        assert engine.load_lora("m", str(out / "lora-1.aslora")) == AsStatus.ALLSPARK_LORA_ALREADY_LOADED  # by file
        shutil.copy(out / "lora-1.aslora", out / "lora-3.aslora")
        assert engine.load_lora("m", "lora-3") == AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR  # lora_max_num is 2
        for name in ("lora-1", "lora-2", None):  # the requests of one adapter run together
            started = [start(p, name) for p in prompts]
            got = [_ids_of(queue) for _, _, queue in started]
            for _, handle, _ in started:
                engine.release_request("m", handle)
            assert got == peft_greedy(src, str(loras / name) if name else None, prompts, 8), name
        status, handle, _ = start(prompts[0], "lora-2", 100)
        assert engine.unload_lora("m", "lora-2") == AsStatus.ALLSPARK_LORA_IN_USE  # its request is unfinished
        engine.sync_request("m", handle)
        assert engine.unload_lora("m", "lora-2") == AsStatus.ALLSPARK_SUCCESS
        assert engine.load_lora("m", str(out / "lora-2.aslora")) == AsStatus.ALLSPARK_SUCCESS  # an absolute path
        engine.release_request("m", handle)
    finally:
        engine.stop_model("m")


def test_mm_info_image_embeddings_as_its_vlm_guide_gives_them(tokenizer_dir, tmp_path):
    """DashInfer's VLM guide: image embeddings as DLPack tensors under the placeholder token id, in mm_info; the
    answer is transformers' for that image (its processor expands the image token to the embedding's rows)."""
    from vision_models import hf_llava_features, hf_llava_greedy, picture, save_llava

    src = save_llava(str(tmp_path / "llava"), tokenizer_dir)
    text = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
    ids, want = hf_llava_greedy(src, text, [picture(31)], 8)
    loader = HuggingFaceModel(src, "llava", user_set_data_type="float32")
    loader.load_model().serialize_to_path(None, str(tmp_path / "as")).free_model()
    engine = allspark.Engine()
    model = DashInferModel(str(tmp_path / "as"), "llava")
    cfg = _runtime(model, "vl")
    engine.install_model(cfg)
    engine.start_model("vl")
    try:
        from transformers import AutoTokenizer

        placeholder = AutoTokenizer.from_pretrained(src).convert_tokens_to_ids("<image>")  # 16 of them in ids
        mm = allspark.MultiMediaInfo()
        mm.set_multimedia_type(0)
        feats = hf_llava_features(src, [picture(31)])[0].contiguous()
        mm.add_multimedia_content(str(placeholder), [torch.utils.dlpack.to_dlpack(feats)])
        gen = _greedy(model, cfg, 8, mm_info=mm)
        gen["max_length"] = len(ids) + 8
        status, handle, queue = engine.start_request_ids("vl", model, ids, gen)
        assert status is AsStatus.ALLSPARK_SUCCESS
        engine.sync_request("vl", handle)
        assert _ids_of(queue) == want
        extra = allspark.MultiMediaInfo()  # a tensor without its run of placeholders is the request's error
        extra.add_multimedia_content(str(placeholder), [feats, feats])
        gen["mm_info"] = extra
        assert engine.start_request_ids("vl", model, ids, gen)[0] is AsStatus.ALLSPARK_PARAM_ERROR
        short = [t for i, t in enumerate(ids) if t != placeholder or ids[i - 1] != placeholder]  # a run of 1
        gen["mm_info"] = mm  # DashInfer: a run is exactly its tensor's rows long
        assert engine.start_request_ids("vl", model, short, gen)[0] is AsStatus.ALLSPARK_PARAM_ERROR
    finally:
        engine.stop_model("vl")
