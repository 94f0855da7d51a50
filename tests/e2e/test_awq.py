"""Calibrated quantization: AWQ (int4 after activation-aware scales) and SmoothQuant (w8a8 after smoothing).

The invariance that makes both correct (a folded per-channel scale leaves the float model's logits unchanged,
checked with transformers' own float32 model), the rounding the AWQ search uses (bit for bit ember's int4), what they
buy over plain rounding on the default model (slow), the cache of calibrated weights and the slices a rank reads,
`ember convert --quantization awq`, and the errors a bad calibration file gets."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import TESTS, default_gguf, hf_float32, save_random_model
from internals import worker_of
from ember import LLM, SamplingParams
from ember.quantization import QuantConfig, quantize_int4
from ember.quantization.calibration import (DEFAULT_TEXT, calibration_sequences, fold_scales, read_calibration_text,
                                            scale_groups)

TEXT = os.path.join(TESTS, "data", "alice_ch1.txt")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "Water boils at"]


def _hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t.float() for n, t in load_file(os.path.join(folder, "model.safetensors")).items()}


def _logits(folder: str, changed: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float32 logits of the checkpoint, and of the checkpoint with changed tensors put in."""
    model = hf_float32(folder)
    with torch.no_grad():
        before = model(ids).logits
        missing, unexpected = model.load_state_dict(changed, strict=False)
        assert not unexpected
        after = model(ids).logits
    return before, after


def _assert_same_logits(before: torch.Tensor, after: torch.Tensor) -> None:
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert rel < 1e-4, rel


@pytest.fixture(scope="module")
def qwen2_mha(tmp_path_factory, tokenizer_dir) -> str:
    """A Qwen2 without GQA: q/k/v biases, and v_proj -> o_proj foldable (its v_proj bias is scaled too)."""
    # non-zero biases, so that scaling them shows
    return save_random_model("Qwen2Config", str(tmp_path_factory.mktemp("qwen2-mha")), tokenizer_dir, seed=3,
                             bias_std=0.5, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)


# ----- the float model is unchanged -----

@pytest.mark.parametrize("kind", ["llama", "llama-mha-untied", "qwen3", "qwen2-mha"])
def test_any_folded_scales_leave_the_float_logits_unchanged(kind, tiny_models, qwen2_mha):
    folder = qwen2_mha if kind == "qwen2-mha" else tiny_models[kind]
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    tensors = _hf_tensors(folder)
    groups = scale_groups(hf_config)
    kinds = {g.kind for g in groups}
    mha = hf_config.num_key_value_heads == hf_config.num_attention_heads
    assert kinds == ({"qkv", "o", "gate_up", "down"} if mha else {"qkv", "gate_up", "down"})
    g = torch.Generator().manual_seed(0)
    changed: set[str] = set()
    for group in groups:  # scales from 1/4 to 4, every group kind, in forward order
        k = tensors[f"{group.linears[0]}.weight"].shape[1]
        changed.update(fold_scales(tensors, group, 4 ** (2 * torch.rand(k, generator=g) - 1)))
    if kind == "qwen2-mha":
        assert "model.layers.0.self_attn.v_proj.bias" in changed
    ids = torch.randint(100, hf_config.vocab_size, (2, 40), generator=g)
    _assert_same_logits(*_logits(folder, {n: tensors[n] for n in changed}, ids))


@pytest.mark.parametrize("algorithm", ["awq", "smoothquant"])
def test_calibrated_scales_leave_the_float_logits_unchanged(algorithm, tiny_models, qwen2_mha):
    """The scales each algorithm finds on the calibration text (AWQ without its clipping, which changes weights on
    purpose; SmoothQuant with down_proj too), folded: the float32 model computes the same logits."""
    from ember.model_loader import open_checkpoint
    from ember.model_loader.calibrated import calibrate
    from ember.quantization.awq import AWQ
    from ember.quantization.smoothquant import SmoothQuant

    quant = QuantConfig.of(algorithm)
    for folder in (tiny_models["llama"], qwen2_mha):
        ckpt = open_checkpoint(folder)
        hf_config = ckpt.hf_config()
        make = (lambda t, c: AWQ(t, c, quant, clip=False)) if algorithm == "awq" else (
            lambda t, c: SmoothQuant(t, c, 0.5, ("qkv", "o", "gate_up", "down")))
        changed = calibrate(ckpt, hf_config, quant, read_calibration_text(None), make=make)
        original = _hf_tensors(folder)
        moved = max(((changed[n] - original[n]).abs().max() / original[n].abs().max()).item() for n in changed)
        assert moved > 0.01  # the scales are not all 1
        ids = torch.randint(100, hf_config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
        _assert_same_logits(*_logits(folder, changed, ids))


def test_the_awq_search_rounds_exactly_as_loading_does():
    from ember.quantization.awq import fake_quantize

    torch.manual_seed(4)
    for k, group in ((256, 128), (576, 64), (96, 32)):  # 576: int4 "g128" falls back to 64 groups
        w = torch.randn(48, k) * torch.rand(1, k) * 3
        quant = QuantConfig("int4", 128 if group != 32 else 32)
        assert quant.linear_layout(k)[1] == group
        assert torch.equal(fake_quantize(w.clone(), quant), quantize_int4(w, group).dequantize())


def test_the_optional_clipping_search_never_raises_the_error_it_measures():
    from ember.quantization.awq import fake_quantize, output_error, search_clip

    torch.manual_seed(5)
    quant = QuantConfig("int4", 64)
    w = torch.randn(32, 128)
    w[:, 3] *= 8  # an outlier column: clipping its groups trades range for resolution
    x = (torch.randn(256, 128) * torch.rand(128)).bfloat16()
    clipped = search_clip(w, x, quant)
    assert clipped.abs().le(w.abs()).all() and not torch.equal(clipped, w)
    assert output_error(x, w - fake_quantize(clipped, quant)) <= output_error(x, w - fake_quantize(w, quant))


def test_calibration_windows_are_spread_over_the_text():
    ids = list(range(5000))
    seqs = calibration_sequences(ids, num=16, length=256)
    assert len(seqs) == 16 and all(len(s) == 256 for s in seqs)
    assert seqs[0][0] == 0 and seqs[-1][-1] == 4999
    assert all(a[-1] < b[0] for a, b in zip(seqs, seqs[1:]))  # no overlap
    assert calibration_sequences(ids[:300], num=16, length=256) == [ids[:256]]
    assert calibration_sequences(ids[:100]) == [ids[:100]]
    with pytest.raises(ValueError, match="calibration_data='x.txt' holds 10 tokens"):
        calibration_sequences(ids[:10], source="x.txt")
    assert 20_000 < os.path.getsize(DEFAULT_TEXT) < 40_000


def test_quant_config_names_and_stores_the_algorithm():
    awq, sq = QuantConfig.of("awq"), QuantConfig.of("smoothquant")
    assert (awq.method, awq.group_size, awq.algorithm, awq.mode) == ("int4", 128, "awq", "awq")
    assert (sq.method, sq.algorithm, sq.mode) == ("w8a8", "smoothquant", "smoothquant")
    assert awq.describe() == "int4 g128 (awq)" and sq.describe() == "w8a8 (smoothquant)"
    assert QuantConfig.from_dict(awq.to_dict()) == awq and awq.to_dict()["algorithm"] == "awq"
    assert "algorithm" not in QuantConfig("int4").to_dict()  # plain configs are stored as before
    with pytest.raises(ValueError, match="algorithm='awq' is not supported with method='int8'"):
        QuantConfig("int8", algorithm="awq")


# ----- what it buys (the default model) -----

def test_awq_and_smoothquant_beat_plain_rounding_on_the_default_model():
    """Perplexity on the first 1,000 tokens of the evaluation text (never calibrated on), float32 activations."""
    from ember.benchmarks.perplexity import perplexity

    ppl = {}
    for mode, kw in {"int4-g128": dict(quantization="int4", quant_group_size=128), "awq": dict(quantization="awq"),
                     "w8a8": dict(quantization="w8a8"), "smoothquant": dict(quantization="smoothquant")}.items():
        llm = LLM(default_gguf(), dtype="float32", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128,
                  enable_prefix_caching=False, **kw)
        with open(TEXT, encoding="utf-8") as f:
            ids = llm.get_tokenizer().encode(f.read())[:1000]
        ppl[mode] = perplexity(llm, ids, window=500)
        llm.shutdown()
    print(ppl)
    assert ppl["awq"] < 0.95 * ppl["int4-g128"], ppl
    assert ppl["smoothquant"] < ppl["w8a8"], ppl


# ----- loading, the cache, convert -----

@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> str:
    """A text of its own (the second half of the shipped one): its results are cached apart."""
    path = tmp_path_factory.mktemp("calib") / "text.txt"
    text = read_calibration_text(None)
    path.write_text(text[len(text) // 2:], encoding="utf-8")
    return str(path)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_convert_awq_stores_the_weights_that_loading_with_awq_builds(llama_dir, calibration_file, tmp_path,
                                                                     monkeypatch):
    from ember.entrypoints.cli import main
    from ember.model_loader import calibrated

    dst = str(tmp_path / "awq.asmodel")
    assert main(["convert", llama_dir, dst, "--quantization", "awq", "--calibration", calibration_file]) == 0
    meta = json.loads((tmp_path / "awq.asmodel").read_text())
    assert meta["quant_config"] == {"method": "int4", "group_size": 128, "embeddings": False, "algorithm": "awq"}
    assert meta["weights"]["tensors"]["model.layers.0.mlp.down_proj.qdata"][0] == "uint8"

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again: the cached weights were not used")

    monkeypatch.setattr(calibrated, "calibrate", no_calibration)  # convert calibrated once; loading reuses it
    live = LLM(llama_dir, dtype="float32", quantization="awq", calibration_data=calibration_file, max_num_seqs=4,
               max_model_len=128)
    assert worker_of(live).loaded.quant == QuantConfig.of("awq")
    want = _tokens(live)
    live.shutdown()
    stored = LLM(dst, dtype="float32", max_num_seqs=4, max_model_len=128)  # no calibration: stored transformed
    assert stored.model_info.quantization == "int4 g128 (awq)"
    assert _tokens(stored) == want
    stored.shutdown()
    stored = LLM(dst, dtype="float32", quantization="awq", max_num_seqs=4, max_model_len=128)
    assert _tokens(stored) == want
    stored.shutdown()
    with pytest.raises(ValueError, match=r"stored quantized as int4 g128 \(awq\)"):
        LLM(dst, quantization="int4")


def test_each_calibration_text_is_cached_apart_and_ranks_read_slices_of_it(llama_dir, calibration_file):
    from ember.distributed import WeightSlice
    from ember.model_loader import open_checkpoint
    from ember.model_loader.calibrated import calibrated_scales, calibrated_tensors, scales_file

    ckpt = open_checkpoint(llama_dir)
    hf_config = ckpt.hf_config()
    quant = QuantConfig.of("smoothquant")
    own, shipped = (calibrated_scales(ckpt, hf_config, quant, c) for c in (calibration_file, None))
    files = [scales_file(ckpt, hf_config, quant, read_calibration_text(c)) for c in (calibration_file, None)]
    assert files[0] != files[1] and all(os.path.isfile(f) for f in files)
    assert own.keys() == shipped.keys() and not all(torch.equal(own[k], shipped[k]) for k in own)
    full = dict(calibrated_tensors(ckpt, hf_config, quant, calibration_file))
    norm, q = "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(full[norm], _hf_tensors(llama_dir)[norm])  # smoothed

    def rank1(name: str) -> WeightSlice | None:  # the second of two tensor-parallel ranks
        if name.endswith(("q_proj.weight", "gate_proj.weight")):
            return WeightSlice(0, 32, 64) if "q_proj" in name else WeightSlice(0, 64, 128)
        return WeightSlice(1, 32, 64) if name.endswith("down_proj.weight") else WeightSlice()

    part = dict(calibrated_tensors(ckpt, hf_config, quant, calibration_file, select=rank1))
    assert set(part) == set(full)
    assert torch.equal(part[q], full[q][32:64]) and torch.equal(part[norm], full[norm])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(part[down], full[down][:, 32:64])


def test_cached_scales_fold_into_the_tensors_calibration_changes(tiny_models, qwen2_mha):
    """Loading folds the cached scales into the checkpoint as it streams (every group kind, a rank's row and column
    slices included); the result is the tensors the calibrator itself changed, to float32 rounding."""
    from ember.distributed import WeightSlice
    from ember.model_loader import open_checkpoint
    from ember.model_loader.calibrated import run_calibration
    from ember.quantization.awq import AWQ
    from ember.quantization.calibration import ScalePlan, apply_scales

    quant = QuantConfig.of("awq")
    for folder in (tiny_models["llama"], qwen2_mha):
        ckpt = open_checkpoint(folder)
        hf_config = ckpt.hf_config()
        calibrator, _ = run_calibration(ckpt, hf_config, quant, read_calibration_text(None),
                                        make=lambda t, c: AWQ(t, c, quant, clip=False))
        scales = calibrator.scales()
        assert {g.kind for g in scale_groups(hf_config) if g.module in scales} >= {"qkv", "gate_up", "down"}
        changed = calibrator.finish()
        plan = ScalePlan.of(hf_config, scales)
        folded = dict(apply_scales(ckpt.tensors(hf_config), plan))
        assert plan.names & set(folded) == set(changed)  # (the plan also names the biases a model may not have)
        for name, t in changed.items():
            torch.testing.assert_close(folded[name], t, rtol=1e-6, atol=0)

        def rank1(name: str) -> WeightSlice:  # rows of column-parallel layers, columns of row-parallel ones
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                return WeightSlice(1, 16, 32)
            return WeightSlice(0, 16, 32) if name.endswith(("proj.weight", "proj.bias")) else WeightSlice()

        part = dict(apply_scales(ckpt.tensors(hf_config, select=rank1), plan, rank1))
        for name in changed:
            assert torch.equal(part[name], rank1(name).apply(folded[name])), name


def test_smoothquant_loads_and_generates(llama_dir):
    llm = LLM(llama_dir, dtype="float32", quantization="smoothquant", max_num_seqs=4, max_model_len=128)
    assert llm.model_info.quantization == "w8a8 (smoothquant)"
    assert all(len(t) == GREEDY.max_tokens for t in _tokens(llm))
    llm.shutdown()


# ----- bad input -----

@pytest.mark.parametrize("case", ["missing", "empty", "not-calibrated", "bad-mode"])
def test_bad_calibration_settings_fail_before_loading(case, llama_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    kwargs, match = {
        "missing": (dict(quantization="awq", calibration_data=str(tmp_path / "nope.txt")),
                    "calibration_data=.*nope.txt' does not exist"),
        "empty": (dict(quantization="awq", calibration_data=str(empty)), "calibration_data=.*empty.txt' is empty"),
        "not-calibrated": (dict(quantization="int4", calibration_data=str(empty)),
                           "calibration_data=.* is only read by quantization='awq' or 'smoothquant'"),
        "bad-mode": (dict(quantization="gptq"), "quantization='gptq' is not supported: .*'awq', 'smoothquant'"),
    }[case]
    with pytest.raises(ValueError, match=match):
        LLM(llama_dir, **kwargs)


def test_a_text_too_short_to_calibrate_on_fails_naming_the_field(llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("We the People.")
    with pytest.raises(ValueError, match=r"calibration_data=.*short.txt' holds \d+ tokens: calibration needs at "
                                         "least 64"):
        LLM(llama_dir, quantization="smoothquant", calibration_data=str(short), max_num_seqs=2, max_model_len=128)


def test_convert_refuses_a_bad_calibration_file(llama_dir, tmp_path, capsys):
    from ember.entrypoints.cli import main

    assert main(["convert", llama_dir, str(tmp_path / "x.asmodel"), "--quantization", "awq", "--calibration",
                 str(tmp_path / "nope.txt")]) == 2
    assert "calibration_data=" in capsys.readouterr().err
    assert main(["convert", llama_dir, str(tmp_path / "x.asmodel"), "--quantization", "int8", "--calibration",
                 DEFAULT_TEXT]) == 2
    assert "only read by quantization='awq' or 'smoothquant'" in capsys.readouterr().err
