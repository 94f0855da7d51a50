"""The EasyDeL vSurge facade: the reference example runs unchanged but for its import (default GGUF model, and a
Hugging Face folder exported from it); greedy streams end with the non-streamed text, which is transformers'
greedy text; a mesh on tp over two CPU ranks gives one rank's tokens; vSurgeApiServer answers the openai client;
without jax the facade runs on strings; every wrong argument and wrong-order call fails clearly."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import runpy
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch
from conftest import TESTS, default_gguf, hf_float32, hf_greedy
from server_utils import metric_sum, running_server

import ember.compat.easydel as ed
from ember.errors import ConfigError

SCRIPTS = os.path.join(TESTS, "compat_scripts")
PROMPT = "USER:What is the capital of France?\nASSISTANT:"


def _surge(path: str, **kw) -> ed.vSurge:
    """A started vSurge in float32 (exact greedy parity) with small limits, so start-up stays short."""
    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        path, dtype=kw.pop("dtype", "float32"), sharding_axis_dims=kw.pop("sharding_axis_dims", (1, 1, 1, -1, 1)),
        config_kwargs=ed.EasyDeLBaseConfigDict(mask_max_position_embeddings=kw.pop("max_length", 512)))
    surge = ed.vSurge.from_model(model, kw.pop("processor", None), max_concurrent_decodes=kw.pop("decodes", 4),
                                 max_prefill_length=256, **kw)
    surge.start()
    return surge


# ----- the reference example -----

EXAMPLE_PREFILL = 512  # the prefill tokens a step the example's surge gets here (see _run_example)


def _run_example(model_path: str | None, monkeypatch, capsys) -> str:
    """The page's example, unchanged but for one size: its prefill_length of 4,096 tokens a step makes the engine
    warm up on two 4,096-token bf16 prefills, about two minutes on 2 cores without fast bf16, while its prompts are
    under 20 tokens. from_model gets max_prefill_length=EXAMPLE_PREFILL instead; everything else is the page's
    (max_length 8,192, 64 concurrent decodes, bf16)."""
    if model_path:
        monkeypatch.setenv("EMBER_EASYDEL_MODEL", model_path)
    from_model = ed.vSurge.from_model.__func__

    def smaller_prefill(cls, *args, **kwargs):
        assert kwargs["max_prefill_length"] == 4096  # the page's prefill_length
        return from_model(cls, *args, **{**kwargs, "max_prefill_length": EXAMPLE_PREFILL})

    monkeypatch.setattr(ed.vSurge, "from_model", classmethod(smaller_prefill))
    capsys.readouterr()
    runpy.run_path(os.path.join(SCRIPTS, "easydel_vsurge_example.py"), run_name="__main__")
    return capsys.readouterr().out


def _check_example_output(out: str) -> None:
    texts = [ast.literal_eval(v) for v in re.findall(r"^  Generated Text: (.*)$", out, re.M)]
    rates = [ast.literal_eval(v) for v in re.findall(r"^  Tokens per second: (.*)$", out, re.M)]
    assert len(texts) == len(rates) == 2  # one result per prompt, each a list over its n=1 generations
    assert all(len(t) == 1 and t[0].strip() for t in texts)
    assert all(len(r) == 1 and r[0] > 0 for r in rates)
    updates: dict[str, list[str]] = {"1": [], "2": []}
    for prompt, value in re.findall(r"^Streaming Update for Prompt (\d): (.*)$", out, re.M):
        updates[prompt].append(ast.literal_eval(value)[0])
    for seq in updates.values():
        assert len(seq) > 5 and seq[-1].strip()
        assert all(b.startswith(a) for a, b in zip(seq, seq[1:]))  # cumulative: every update extends the last
        assert len(set(seq)) > 5  # and it grows as tokens arrive


def test_reference_example_runs_on_default_model(monkeypatch, capsys):
    pytest.importorskip("jax")
    _check_example_output(_run_example(None, monkeypatch, capsys))


@pytest.fixture(scope="module")
def exported_hf(tmp_path_factory) -> str:
    """The default model as a Hugging Face folder: bfloat16 safetensors, config, tokenizer files."""
    from ember.model_loader.export import export_hf_folder

    return export_hf_folder(default_gguf(), str(tmp_path_factory.mktemp("smollm2-hf") / "model"), torch.bfloat16)


def test_reference_example_runs_on_hf_folder(exported_hf, monkeypatch, capsys):
    pytest.importorskip("jax")
    _check_example_output(_run_example(exported_hf, monkeypatch, capsys))


# ----- greedy: stream == non-stream == transformers -----

def test_greedy_stream_ends_with_the_final_text_and_matches_transformers():
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_gguf())
    processor = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    surge = _surge(default_gguf(), processor=processor)
    try:
        prompts = [PROMPT, "USER:Explain the concept of recursion\nASSISTANT:"]
        params = ed.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

        async def both():
            final = await surge.generate(prompts, params, stream=False)
            stream = [snapshot async for snapshot in surge.generate(prompts, params, stream=True)]
            return final, stream

        final, stream = asyncio.run(both())
    finally:
        surge.stop()
    assert [s.finished for s in stream[-1]] == [True, True] and not all(s.finished for s in stream[0])
    for i, result in enumerate(final):
        assert stream[-1][i].text == result.text == result.accumulated_text
        assert stream[-1][i].token_ids == result.token_ids and result.finish_reason == ["length"]
        assert result.num_generated_tokens == [24] and result.tokens_per_second[0] > 0
        assert 0 < result.time_spent_computing[0] < 600
    hf = hf_float32(folder, gguf_file=name)
    for prompt, result in zip(prompts, final):
        assert result.token_ids[0] == hf_greedy(hf, processor(text=prompt)["input_ids"], 24)
        assert result.text[0] == processor.decode(result.token_ids[0], skip_special_tokens=True)


# ----- parallelism: the mesh's tp axis -----

def test_tp_axis_over_two_cpu_ranks_gives_one_ranks_tokens(llama_dir):
    prompts = ["Once upon a time", "The quick brown fox", "In a galaxy"]
    params = ed.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for dims in ((1, 1, 1, -1, 1), (1, 1, 1, 2, 1), (1, 2, 1, 1, 1)):  # -1 on CPU: one device; tp=2; fsdp=2
        surge = _surge(llama_dir, sharding_axis_dims=dims)
        try:
            assert len(surge.client.rank_reports()) == surge.model.tensor_parallel_size
            tokens[dims] = [r.token_ids[0] for r in asyncio.run(surge.generate(prompts, params))]
        finally:
            surge.stop()
    assert {tuple(map(tuple, t)) for t in tokens.values()} == {tuple(map(tuple, tokens[(1, 1, 1, -1, 1)]))}
    assert [ed.AutoEasyDeLModelForCausalLM.from_pretrained(llama_dir, sharding_axis_dims=d).tensor_parallel_size
            for d in tokens] == [1, 2, 2]


# ----- vSurgeApiServer -----

SERVER_SCRIPT = textwrap.dedent("""
    import sys
    import ember.compat.easydel as ed

    path, port = sys.argv[1], int(sys.argv[2])
    surges = {}
    for name, decodes in (("tiny-a", 4), ("tiny-b", 2)):
        model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(path, dtype="float32", config_kwargs=
                                                               ed.EasyDeLBaseConfigDict(mask_max_position_embeddings=256))
        surges[name] = ed.vSurge.from_model(model, None, max_concurrent_decodes=decodes, max_prefill_length=128)
    ed.vSurgeApiServer(surges).fire(host="127.0.0.1", port=port)
    for surge in surges.values():
        surge.stop()
    print("stopped", flush=True)
""")


def test_api_server_answers_the_openai_client(llama_dir, tmp_path):
    from openai import OpenAI

    from ember import LLM, SamplingParams

    script = tmp_path / "serve.py"
    script.write_text(SERVER_SCRIPT)
    with running_server(command=lambda port: [sys.executable, str(script), llama_dir, str(port)]) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        assert sorted(m.id for m in client.models.list().data) == ["tiny-a", "tiny-b"]
        texts = {}
        for name in ("tiny-a", "tiny-b"):
            out = client.completions.create(model=name, prompt="Once upon a time", max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.model == name and out.usage.completion_tokens == 10
            texts[name] = out.choices[0].text
        chunks = client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0, stream=True)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        with pytest.raises(Exception, match="model_not_found|does not exist"):
            client.completions.create(model="other", prompt="x", max_tokens=2)
        with urllib.request.urlopen(server.url + "/metrics") as r:  # one series per engine
            metrics = r.read().decode()
        for name, capacity in (("tiny-a", 4 + 256), ("tiny-b", 2 + 256)):
            assert metric_sum(metrics, "ember_server_request_capacity", model_name=name) == capacity
            assert metric_sum(metrics, "ember_request_success_total", model_name=name, finish_reason="length") >= 1
        server.proc.terminate()
        server.proc.wait(60)
        assert server.proc.returncode == 0 and "stopped" in server.log()
    with LLM(llama_dir, dtype="float32", max_model_len=256, max_num_seqs=2) as llm:
        native = llm.generate("Once upon a time", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    assert texts == {"tiny-a": native, "tiny-b": native}


# ----- without jax -----

NO_JAX = textwrap.dedent("""
    import asyncio, json, sys

    class HideJax:  # as if jax were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib"):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, HideJax())
    import ember.compat.easydel as ed

    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        sys.argv[1], dtype="float32", param_dtype="float32", precision="highest",
        config_kwargs=ed.EasyDeLBaseConfigDict(mask_max_position_embeddings=128, kvdtype="float32"))
    surge = ed.vSurge.from_model(model, None, max_concurrent_decodes=2, max_prefill_length=64)
    surge.start()
    out = asyncio.run(surge.generate("Once upon a time", ed.SamplingParams(max_tokens=6, temperature=0,
                                                                          ignore_eos=True)))
    surge.stop()
    print(json.dumps({"ids": out[0].token_ids[0], "dtype": str(model.dtype), "precision": model.precision,
                      "jax": sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))}))
""")


def test_runs_without_jax_on_string_dtypes(llama_dir):
    from ember import LLM, SamplingParams

    run = subprocess.run([sys.executable, "-c", NO_JAX, llama_dir], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["jax"] == [] and out["dtype"] == "torch.float32" and out["precision"] == "HIGHEST"
    with LLM(llama_dir, dtype="float32", max_model_len=128, max_num_seqs=2) as llm:
        native = llm.generate("Once upon a time", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert out["ids"] == native


# ----- mapping and errors -----

def test_jax_objects_are_accepted_as_they_are(llama_dir):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    m = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        llama_dir, dtype=jnp.float32, param_dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
        config_kwargs=ed.EasyDeLBaseConfigDict(kvdtype=jnp.float32))
    assert m.dtype == torch.float32 and m.precision == "HIGHEST"
    bf16 = ed.AutoEasyDeLModelForCausalLM.from_pretrained(llama_dir, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                          precision=jax.lax.Precision.DEFAULT)
    assert bf16.dtype == torch.bfloat16 and bf16.precision == "DEFAULT"


def test_settings_map_onto_the_engine(llama_dir):
    Q = ed.EasyDeLQuantizationMethods
    m = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        llama_dir, quantization_method=Q.A8BIT, quantization_block_size=64,
        config_kwargs=ed.EasyDeLBaseConfigDict(freq_max_position_embeddings=300, mask_max_position_embeddings=200,
                                               kv_cache_quantization_method=Q.NF4,
                                               attn_mechanism=ed.AttentionMechanisms.RAGGED_PAGE_ATTENTION,
                                               gradient_checkpointing=ed.EasyDeLGradientCheckPointers.NOTHING_SAVEABLE))
    s = m.engine_settings
    assert (s["quantization"], s["kv_cache_dtype"], s["dtype"], s["max_model_len"]) == ("int8", "uint4",
                                                                                       torch.bfloat16, 200)
    assert m.config.freq_max_position_embeddings == 300 and m.granted_mask_max_position_embedding == 200
    assert ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        llama_dir, quantization_method=Q.NF4, quantization_block_size=32).engine_settings["quant_group_size"] == 32
    assert ed.AutoEasyDeLModelForCausalLM.from_pretrained(llama_dir).engine_settings["quantization"] == "none"
    surge = ed.vSurge.from_model(m, None, max_concurrent_decodes=3, max_concurrent_prefill=2, prefill_lengths=[64, 128],
                                 max_prefill_length=128, extra_eos_token_ids=7, tokens_per_page=32, num_pages=20)
    c = surge.engine_config
    assert (c.max_num_seqs, c.max_num_prefill_seqs, c.max_num_batched_tokens, c.max_model_len, c.seed) == (3, 2, 128,
                                                                                                          200, 894)
    assert (c.block_size, c.max_kv_cache_tokens, surge.extra_eos_token_ids) == (32, 640, (7,))
    assert surge.vsurge_name == f"llama-{m.num_parameters / 1e9:.2f}b"
    with pytest.raises(ValueError, match="max_length=4096 is out of range"):  # the tiny model has 512 positions
        ed.vSurge.from_model(m, None, max_length=4096)
    d = ed.vSurge.from_model(m, None)  # EasyDeL's defaults: max_length from the model, half of it a prefill step
    assert (d.engine_config.max_num_batched_tokens, d.engine_config.max_num_prefill_seqs) == (100, 1)


def test_odriver_and_vdriver_make_the_same_surge(llama_dir):
    """The page builds its surge 'with create_odriver' (EasyDeL 0.1's paged-attention driver) and its code with
    from_model (the vDriver): all three are one engine here; page_size is the KV block size, hbm_utilization the
    device's memory share on CUDA; a page cache or manager of EasyDeL's own is refused."""
    m = ed.AutoEasyDeLModelForCausalLM.from_pretrained(llama_dir, dtype="float32",
                                                       config_kwargs=ed.EasyDeLBaseConfigDict(
                                                           mask_max_position_embeddings=256))
    o = ed.vSurge.create_odriver(m, None, page_size=32, hbm_utilization=0.5, max_concurrent_prefill=2,
                                 max_concurrent_decodes=3, max_prefill_length=64, seed=5, vsurge_name="o")
    v = ed.vSurge.create_vdriver(m, None, max_concurrent_decodes=3, max_prefill_length=64, seed=5)
    f = ed.vSurge.from_model(m, None, max_concurrent_decodes=3, max_prefill_length=64, seed=5)
    assert (o.engine_config.block_size, o.engine_config.max_num_prefill_seqs, o.vsurge_name) == (32, 2, "o")
    assert o.engine_config.kv_cache_memory_fraction == (0.5 if torch.cuda.is_available() else None)
    assert v.engine_config == f.engine_config
    with pytest.raises(ValueError, match="storage=object is not supported"):
        ed.vSurge.create_odriver(m, None, storage=object())
    with pytest.raises(ValueError, match="hbm_utilization=1.5 is out of range"):
        ed.vSurge.create_odriver(m, None, hbm_utilization=1.5)
    surge = ed.vSurge.create_odriver(m, None, max_concurrent_decodes=2, max_prefill_length=64)
    surge.start()
    try:
        greedy = ed.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        assert asyncio.run(surge.generate("Once upon", greedy))[0].token_ids == \
            asyncio.run(_started(f).generate("Once upon", greedy))[0].token_ids
    finally:
        surge.stop()
        f.stop()


def _started(surge: ed.vSurge) -> ed.vSurge:
    surge.start()
    return surge


def test_param_dtype_and_kvdtype(llama_dir):
    """EasyDeL keeps the weights in param_dtype and casts them to dtype for every product: float32 parameters
    computed in bfloat16 are held in bfloat16 (the same products); narrower parameters than the compute dtype are
    refused with the reason. kvdtype: the model's dtype, or refused (ember's float cache is the model's dtype)."""
    jnp = pytest.importorskip("jax").numpy
    load = ed.AutoEasyDeLModelForCausalLM.from_pretrained
    assert load(llama_dir, dtype=jnp.bfloat16, param_dtype=jnp.float32).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="param_dtype=bfloat16 with dtype=float32 is not supported"):
        load(llama_dir, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    kv = ed.EasyDeLBaseConfigDict
    assert load(llama_dir, dtype=jnp.float32, config_kwargs=kv(kvdtype=jnp.float32)).engine_settings[
        "kv_cache_dtype"] == "auto"
    with pytest.raises(ValueError, match="kvdtype=bfloat16 with dtype=float32 is not supported"):
        load(llama_dir, dtype=jnp.float32, config_kwargs=kv(kvdtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="kvdtype='float8_e5m2' is not supported"):
        load(llama_dir, dtype=jnp.bfloat16, config_kwargs=kv(kvdtype=jnp.float8_e5m2))
    quantized = load(llama_dir, dtype=jnp.float32, config_kwargs=kv(
        kvdtype=jnp.bfloat16, kv_cache_quantization_method=ed.EasyDeLQuantizationMethods.A8BIT))
    assert quantized.engine_settings["kv_cache_dtype"] == "int8"  # a quantized cache holds neither float


def test_guided_decoding_is_enforced(llama_dir):
    """EasyDeL's SamplingParams.guided_decoding (GuidedDecodingParams, from easydel.inference.sampling_params):
    EasyDeL stores it; ember constrains the output to it."""
    from ember.compat.easydel.inference.sampling_params import GuidedDecodingParams

    surge = _surge(llama_dir, max_length=256)
    try:
        params = [ed.SamplingParams(max_tokens=12, temperature=0, guided_decoding=g) for g in (
            GuidedDecodingParams(choice=["red", "green", "blue"]), {"regex": "[a-c]{3}-[0-9]{2}"},
            GuidedDecodingParams(grammar='start: "yes" | "no"'))]
        out = asyncio.run(surge.generate(["Pick one:"] * 3, params))
        assert out[0].text[0] in ("red", "green", "blue")
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", out[1].text[0])
        assert out[2].text[0] in ("yes", "no")
    finally:
        surge.stop()
    with pytest.raises(ValueError, match="structural_tag"):
        ed.SamplingParams(guided_decoding=GuidedDecodingParams(structural_tag="x"))
    with pytest.raises(ValueError, match="regexp"):
        ed.SamplingParams(guided_decoding={"regexp": "x"})
    with pytest.raises(ValueError, match="exactly one"):
        ed.SamplingParams(guided_decoding={"regex": "a", "choice": ["a"]})


@pytest.mark.parametrize("kwargs, match", [
    (dict(sharding_axis_dims=(2, 1, 1, 1, 1)), "'dp'.*separate engines"),
    (dict(sharding_axis_dims=(1, 1, 1, 1, 2)), "'sp'.*no sequence parallelism"),
    (dict(sharding_axis_dims=(1, 1, 1, 3, 1)), "tensor_parallel_size=3 is out of range"),
    (dict(sharding_axis_dims=(1, 1, -1, -1, 1)), "at most one -1"),
    (dict(quantization_method="fp8"), "quantization_method='fp8' is not supported"),
    (dict(dtype="int8"), "dtype='int8' is not a supported dtype"),
    (dict(precision="low"), "precision='low' is not supported"),
    (dict(backend=ed.EasyDeLBackends.TPU), "backend=.* is not supported"),
    (dict(config_kwargs={"rope_typo": 1}), "rope_typo"),
    (dict(config_kwargs={"mask_max_position_embeddings": 10**6}), "out of range"),
    (dict(config_kwargs={"attn_mechanism": "fast"}), "attn_mechanism='fast' is not supported"),
    (dict(partition_rules=((".*", None),)), "partition_rules=.* is not supported"),
    (dict(unknown_arg=1), "unknown_arg"),
])
def test_bad_model_arguments_fail_before_loading(llama_dir, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ed.AutoEasyDeLModelForCausalLM.from_pretrained(llama_dir, **kwargs)


def test_hub_name_not_on_disk_fails_clearly(monkeypatch, tmp_path):
    """The page's hub id, offline and absent from the cache: the error names the id and the cache it looked in."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="'Qwen/Qwen3-8B'.*not in the Hugging Face cache"):
        ed.AutoEasyDeLModelForCausalLM.from_pretrained("Qwen/Qwen3-8B")


def test_wrong_order_and_bad_requests_fail_clearly(llama_dir):
    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        llama_dir, dtype="float32", config_kwargs=ed.EasyDeLBaseConfigDict(mask_max_position_embeddings=128))
    surge = ed.vSurge.from_model(model, None, max_concurrent_decodes=2, max_prefill_length=64)
    with pytest.raises(RuntimeError, match="not started: call start"):
        surge.generate("hi")
    surge.compile()
    with pytest.raises(RuntimeError, match="not started: call start"):  # compiled is not started
        surge.generate("hi")
    surge.start()
    try:
        with pytest.raises(ValueError, match="sampling_params must be SamplingParams or None"):
            surge.generate("hi", [ed.SamplingParams()])
        with pytest.raises(ValueError, match="Lengths of prompts and sampling_params"):
            surge.generate(["a", "b"], [ed.SamplingParams()])
        with pytest.raises(ValueError, match="prompts must be a string"):
            surge.generate(None)
        with pytest.raises(ValueError, match="temperature=nan"):
            ed.SamplingParams(temperature=float("nan"))
        with pytest.raises(ValueError, match="logprobs=1 is not supported"):
            ed.SamplingParams(logprobs=1)
        with pytest.raises(ValueError, match="max_model_len"):  # a prompt past max_length, before any work
            asyncio.run(surge.generate("word " * 200))
        assert asyncio.run(surge.generate([])) == []
        # EasyDeL's coroutine shape: `await generate(stream=True)` returns the iterator
        async def awaited_stream():
            return [s async for s in await surge.generate("Once", ed.SamplingParams(max_tokens=3), stream=True)]
        assert asyncio.run(awaited_stream())[-1][0].finished
        with pytest.raises(TypeError, match="awaited, not iterated"):
            surge.generate("hi").__aiter__()
        bad = asyncio.run(surge.generate(["Once", "The"], [ed.SamplingParams(max_tokens=4, bad_words=["the"]),
                                                            ed.SamplingParams(max_tokens=4, detokenize=False)]))
        tok = surge.client.tokenizer
        banned = {ids[0] for w in ("the", " the") if len(ids := tok.encode(w, add_special_tokens=False)) == 1}
        assert banned and not banned & set(bad[0].token_ids[0])
        assert bad[1].text == [""] and len(bad[1].token_ids[0]) == 4
        assert surge.count_tokens("Once upon a time") == len(surge.client.tokenizer.encode("Once upon a time"))

        async def watch_running():  # max_concurrent_decodes=2 bounds the running batch; the rest wait
            seen = []
            async for _ in surge.generate(["a", "b", "c", "d", "e"], ed.SamplingParams(max_tokens=8, ignore_eos=True),
                                          stream=True):
                seen.append(surge.client.stats()["running"])
            return seen
        assert max(asyncio.run(watch_running())) == 2

        async def leave_early():  # leaving the loop aborts the requests
            async for _ in surge.generate("Once", ed.SamplingParams(max_tokens=100, ignore_eos=True), stream=True):
                break
            for _ in range(100):
                await asyncio.sleep(0.05)
                if surge.client.stats()["running"] == 0:
                    return True
            return False
        assert asyncio.run(leave_early())
    finally:
        surge.stop()
    with pytest.raises(RuntimeError, match="was stopped: call start"):
        surge.generate("hi")
