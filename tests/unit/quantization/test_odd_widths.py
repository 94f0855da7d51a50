"""Quantized weights whose widths torch's packed ops do not take: ``_weight_int8pack_mm`` crashes the process or
returns garbage for K not a multiple of 16, ``_weight_int4pack_mm_for_cpu`` raises at the call for groups outside
32-256. ``select_path`` keeps such weights off those ops at load, with ember's kernels built and without them, and
every row count then matches a float32 matmul of the dequantized weight (the reference)."""

from __future__ import annotations

import pytest
import torch

import ember.quantization.kernels as qk
from ember.quantization import QuantizedMatmul, quantize_int4, quantize_int8

CPU = torch.device("cpu")


@pytest.fixture(params=["ember", "torch"])
def kernels(request, monkeypatch):
    """'ember': ember's quantized GEMMs where this machine built them; 'torch': as on a machine without them."""
    if request.param == "ember":
        if qk._ember_gemm() is None:
            pytest.skip("ember's quantized GEMMs are not built here (no AVX512-BF16)")
    else:
        monkeypatch.setattr(qk, "_ember_gemm", lambda: None)
    return request.param


@pytest.mark.parametrize("k", [12, 36, 70, 1000])
def test_int8_widths_torch_cannot_take_never_reach_its_op(kernels, k):
    path = qk.select_path("int8", CPU, 70, k, k)
    assert path == ("cpu-int8" if kernels == "ember" else "portable")
    assert qk.select_path("int8", CPU, 70, 64, 64) == "cpu-int8"  # a width it takes: its op


@pytest.mark.parametrize("group,torch_takes", [(16, False), (4, False), (32, True), (128, True)])
def test_int4_groups_torch_cannot_take_run_embers_kernel_or_the_portable_path(kernels, group, torch_takes):
    path = qk.select_path("int4", CPU, 128, 256, group)
    assert path == ("cpu-int4" if torch_takes or kernels == "ember" else "portable")
    assert qk.select_path("int4", CPU, 70, 256, 32) == "portable"  # not whole 64-row blocks


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("n,k", [(70, 36), (64, 70), (128, 1000), (70, 12), (64, 64)])
def test_int8_weights_of_any_width_match_the_dequantized_weight(kernels, invariant, n, k):
    torch.manual_seed(n + k)
    qt = quantize_int8(torch.randn(n, k))
    mm = QuantizedMatmul("int8", qt, batch_invariant=invariant)
    ref_w = qt.dequantize()
    for rows in (1, 4, 7, 130):  # ember's row kernel, its panels (or torch's op) and the dense path's row counts
        x = torch.randn(rows, k)
        ref = x.bfloat16().float() @ ref_w.t()
        y = mm(x.bfloat16()).float()
        assert ((y - ref).norm() / ref.norm()).item() < 0.01, (mm.path, rows)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("group", [16, 32])
def test_int4_weights_of_any_group_match_the_dequantized_weight(kernels, invariant, group):
    torch.manual_seed(group)
    qt = quantize_int4(torch.randn(128, 96), group)
    mm = QuantizedMatmul("int4", qt, batch_invariant=invariant)
    ref_w = qt.dequantize()
    for rows in (1, 7, 130):
        x = torch.randn(rows, 96)
        ref = x.bfloat16().float() @ ref_w.t()
        y = mm(x.bfloat16()).float()
        assert ((y - ref).norm() / ref.norm()).item() < 0.02, (mm.path, rows)


@pytest.mark.parametrize("k", [1, 2, 36])
def test_w8a8_weights_of_one_input_take_the_exact_float_products(kernels, k):
    """torch._int_mm returns wrong products for K = 1: such a weight takes the portable path, whose float32
    products are exact; every width against the integer products (int64) rescaled as the path documents."""
    from ember.quantization.tensor import quantize_int8_symmetric

    assert qk.select_path("w8a8", CPU, 129, k, k) == ("portable" if k == 1 else "cpu-w8a8")
    torch.manual_seed(k)
    qt = quantize_int8(torch.randn(129, k))
    mm = QuantizedMatmul("w8a8", qt)
    for rows in (1, 13, 64):
        x = torch.randn(rows, k)
        xq, xs = quantize_int8_symmetric(x, dim=1)
        ref = (xq.long() @ qt.data.long().t()).double() * xs.double() * qt.scales.view(-1).double()
        y = mm(x).double()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-6, (mm.path, rows)


def test_the_packed_ops_refuse_a_shape_they_cannot_take_instead_of_crashing():
    """The last guard, should a path be forced (``path=``) past select_path: a RuntimeError, not a crash."""
    qt = quantize_int8(torch.randn(64, 36))
    mm = QuantizedMatmul("int8", qt, path="cpu-int8", batch_invariant=False)
    with pytest.raises(RuntimeError, match=r"_weight_int8pack_mm cannot take K=36 \(a multiple of 16 only\)"):
        mm.impl.packed_mm(torch.randn(3, 36).bfloat16())
    q4 = quantize_int4(torch.randn(64, 64), 16)
    mm4 = QuantizedMatmul("int4", q4, path="cpu-int4")
    with pytest.raises(RuntimeError, match=r"_weight_int4pack_mm_for_cpu cannot take groups of 16"):
        mm4.impl.packed_mm(torch.randn(3, 64).bfloat16())


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["ember kernels", "batch_invariant=False", "torch ops"])
def test_a_model_of_odd_widths_runs_int8_and_matches_transformers(tmp_path, tokenizer_dir, monkeypatch, setting):
    """A random-initialised Llama with hidden size 36 and MLP width 70 (K = 36 and 70 reach the int8 matmuls; before
    the checks, torch's op crashed the process on them without ember's kernels, or with batch_invariant=False from
    five rows on), int8: ember's greedy tokens against transformers' over the same int8 weights, with the
    projections' inputs and outputs rounded to bf16 where ember's int8 kernels round them."""
    from conftest import hf_float32, hf_greedy, random_prompts, save_random_model
    from internals import worker_of
    from ember import LLM, SamplingParams

    path = save_random_model("LlamaConfig", str(tmp_path / "odd"), tokenizer_dir, hidden_size=36, intermediate_size=70,
                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    if setting == "torch ops":
        monkeypatch.setattr(qk, "_ember_gemm", lambda: None)
    llm = LLM(path, dtype="float32", quantization="int8", max_num_seqs=4, max_model_len=128,
              kv_cache_memory="16MiB", batch_invariant=setting != "batch_invariant=False")
    try:
        paths = {m.qmm.path for m in worker_of(llm).loaded.model.modules() if getattr(m, "qmm", None) is not None}
        prompts = random_prompts(3, 6, 20, 49152, seed=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert paths == ({"portable"} if setting == "torch ops" else {"cpu-int8"})
    model = hf_float32(path)
    bf16 = setting != "torch ops"  # ember's int8 kernels take bf16 activations and return bf16 (the portable path
    with torch.no_grad():          # computes in the model's float32): the reference rounds where they round
        for name, module in model.named_modules():
            if name.endswith("proj"):  # the int8 weights ember computes with, as float32
                module.weight.copy_(quantize_int8(module.weight.data).dequantize(torch.float32))
                if bf16:
                    module.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(),))
                    module.register_forward_hook(lambda m, args, out: out.bfloat16().float())
    for out, prompt in zip(outs, prompts):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt, 8)
