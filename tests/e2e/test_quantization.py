"""Quantization: the stored layouts against independent references (gguf's own dequantizer, torch's dense
matmul), perplexity of every mode against float32 on the default model and on a random-initialised one, memory
footprints, and the surfaces (LLM, ember convert, the DashInfer facade)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import TESTS, default_gguf
from internals import worker_of
from ember import LLM, SamplingParams
from ember.benchmarks.perplexity import perplexity
from ember.layers.kv_cache import KVCacheFormat
from ember.quantization import QuantConfig, QuantizedMatmul, from_gguf, quantize_int4, quantize_int8
from ember.quantization.kernels import pack_cpu_int4, torch_int4_block_rows, unpack_cpu_int4

TEXT = os.path.join(TESTS, "data", "alice_ch1.txt")
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n", "My favourite food is", "The quick brown fox",
           "In 1492, Columbus", "To make tea, first", "The largest planet is", "SELECT * FROM",
           "Dear Sir or Madam,", "The meaning of life is", "1, 2, 3, 4,", "Photosynthesis is"]


# ----- layouts and kernels -----

def test_int8_and_int4_round_trip_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    q8 = quantize_int8(w)
    assert q8.data.dtype == torch.int8 and q8.scales.shape == (128, 1)
    assert ((q8.dequantize() - w).abs() <= q8.scales / 2 + 1e-6).all()
    q4 = quantize_int4(w, 32)
    assert q4.data.shape == (128, 128) and q4.scales.shape == (128, 8) and q4.offsets.shape == (128, 8)
    err = (q4.dequantize() - w).abs().view(128, 8, 32)
    assert (err <= q4.scales[..., None] * 0.5001 + 1e-6).all()
    # the stored form holds every 4-bit value once: element 2i in the low nibble
    assert torch.equal(q4.unpacked()[:, 0], q4.data[:, 0] & 0xF) and torch.equal(q4.unpacked()[:, 1], q4.data[:, 0] >> 4)


def test_cpu_int4_pack_is_inverted_exactly():
    """torch's CPU pack (64 rows a block on AVX512, 32 on AVX2: the block is found on the machine) and ember's own
    64-row pack, which ember's kernel reads on every CPU, both unpack to the values."""
    q = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_cpu_int4(packed, 192, 96, torch_int4_block_rows()).to(torch.int32), q)
    assert torch.equal(unpack_cpu_int4(pack_cpu_int4(q), 192, 96).to(torch.int32), q)
    if torch_int4_block_rows() == 64:
        assert torch.equal(pack_cpu_int4(q), packed)


def _weight(method: str, device: str = "cpu"):
    torch.manual_seed(1)
    w = torch.randn(192, 256)
    return (quantize_int4(w, 64) if method == "int4" else quantize_int8(w)).to(device)


@pytest.mark.parametrize("method,path", [(m, p) for m in ("int8", "int4", "w8a8") for p in (f"cpu-{m}", "portable")])
@pytest.mark.parametrize("rows", [1, 7, 20, 200])
def test_quantized_matmul_matches_dense_matmul_of_the_dequantized_weight(method, path, rows):
    qt = _weight(method)
    x = torch.randn(rows, 256)
    ref = x @ qt.dequantize().t()
    mm = QuantizedMatmul(method, qt, path=path)
    y = mm(x.bfloat16()).float()
    # bf16 activations (and, for w8a8, int8 activations: one step of 1/127 of the row's max)
    tol = 0.05 if method == "w8a8" else 0.02
    assert ((y - ref).norm() / ref.norm()).item() < tol
    w = qt.dequantize()
    assert ((mm.dequantized(torch.float32) - w).norm() / w.norm()).item() < 0.01  # bf16 scales on the CPU ops


@pytest.mark.parametrize("method,group", [("int4", 32), ("int4", 128), ("int8", None)])
def test_ember_quantized_gemm_matches_the_dequantized_weight_at_every_row_count(method, group):
    """ember's AVX512-BF16 kernels (the CPU paths from a few rows on) against a float32 matmul of the weight as the
    path holds it: every row-block tail (1..13 rows; int4's panel path from 128 rows, whose row spans split at 203),
    several column panels, two K (int8: and a K that is neither a multiple of 64 nor of 4)."""
    from ember.quantization.kernels import _ember_gemm

    kernels = _ember_gemm()
    if kernels is None:
        pytest.skip("ember's quantized GEMM is not built on this machine (no AVX512-BF16): torch's ops run")
    torch.manual_seed(2)
    odd = ((64, 98),) if method == "int8" else ()  # int8's panel fill reads K in 64-byte chunks: a short last one
    for n, k in ((192, 256), (128, 1536), *odd):
        w = torch.randn(n, k) * 0.05
        mm = QuantizedMatmul(method, quantize_int4(w, group) if method == "int4" else quantize_int8(w))
        held = mm.dequantized(torch.float32)
        for rows in (*range(1, 14), 64, *range(128, 135), 203):
            x = torch.randn(rows, k).bfloat16()
            if method == "int4":
                y = kernels.int4_gemm(x, mm.impl.w, mm.impl.s, group)
            else:
                y = kernels.int8_gemm(x, mm.impl.w, mm.impl.s32)
            ref = x.float() @ held.t()
            # bf16 weights in the panel and a bf16 result: about 2**-8 relative
            assert ((y.float() - ref).norm() / ref.norm()).item() < 6e-3, (n, k, rows)


def test_fused_w8a8_kernel_is_the_integer_product_rescaled():
    """ember's fused w8a8 linear against a reference of the same arithmetic in plain torch ops (per-row int8
    activations, round half to even, integer products exact in float64, float32 rescale): bf16 and float32 inputs,
    the row kernel's counts (1-4, with weight rows left over after its blocks of 8 and 4) and the GEMM's across its
    chunks (32 MB of products), K with a vector tail, and an all-zero row."""
    from ember.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("ember's CPU kernels are not built here: the w8a8 path runs torch's ops")
    torch.manual_seed(3)
    # 70000 int32 columns: 119-row chunks; 203 weight rows: 3 past the row kernel's last whole block
    for n, k, counts in ((70000, 100, (1, 3, 4, 5, 119, 300)), (203, 640, (1, 2, 3, 4))):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        ws = torch.rand(n) / 100
        for dtype in (torch.bfloat16, torch.float32):
            for rows in counts:
                x = (torch.randn(rows, k) * 4).to(dtype)
                x[rows // 2] = 0
                xs = (x.float().abs().amax(1, keepdim=True) / 127).clamp(min=1e-10)
                q = torch.round(x.float() / xs).clamp(-127, 127).double()  # float32 quotient, round half to even
                ref = ((q @ w.double().t()).float() * xs * ws).to(dtype)  # products < 2**24: exact in float32
                y = kernels.w8a8_linear(x, w, ws)
                assert y.dtype == dtype and torch.equal(y, ref), (n, dtype, rows)
                assert not y[rows // 2].any()


def test_w8a8_products_buffer_made_in_inference_mode_serves_calls_outside_it():
    """The fused w8a8 GEMM keeps its int32 products' buffer per thread; one first made under inference mode (the
    calibration's scoring pass) must still take a later call's products outside it."""
    import threading

    from ember.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("ember's CPU kernels are not built here: the w8a8 path runs torch's ops")
    w, ws, x = torch.randint(-127, 128, (64, 32), dtype=torch.int8), torch.rand(64), torch.randn(8, 32)
    out, errors = [], []

    def run() -> None:  # a fresh thread: a fresh buffer
        try:
            with torch.inference_mode():
                out.append(kernels.w8a8_linear(x, w, ws).clone())
            out.append(kernels.w8a8_linear(x, w, ws))
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors and torch.equal(out[0], out[1])


def test_cpu_weights_take_the_packed_ops():
    assert [QuantizedMatmul(m, _weight(m)).path for m in ("int8", "int4", "w8a8")] == ["cpu-int8", "cpu-int4",
                                                                                       "cpu-w8a8"]


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_cuda_paths_lay_weights_out_as_torchs_kernels_expect(method):
    """No GPU here: fake tensors run each CUDA path's re-layout and call through torch's checks of the kernels'
    inputs (the values are checked on a GPU by the next test and by the self-check at load)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    qt = _weight(method)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: None if t is None else mode.from_tensor(t)  # noqa: E731
        mm = QuantizedMatmul(method, type(qt)(qt.kind, fake(qt.data), fake(qt.scales), fake(qt.offsets),
                                              qt.group_size), path=f"cuda-{method}")
        for rows in (1, 7, 200):
            y = mm(torch.empty(rows, 256))
            assert y.shape == (rows, 192) and y.dtype == torch.float32
    if method == "int4":  # tinygemm's tiles: [N / 8, K / (16 * inner_k_tiles), 32, inner_k_tiles / 2]
        assert tuple(mm.impl.w.shape) == (192 // 8, 256 // 128, 32, 4)


def test_self_check_rejects_a_kernel_that_disagrees(monkeypatch, caplog):
    """The check that guards the (GPU-untested) CUDA paths at load, run here on a CPU path and a broken copy."""
    from ember.quantization import kernels

    monkeypatch.setattr(kernels, "_CHECKED", {})
    qt = _weight("int4")
    assert QuantizedMatmul("int4", qt)._self_check(qt, torch.device("cpu"))
    broken = QuantizedMatmul("int4", qt)
    broken.impl.s = broken.impl.s.flip(-2)  # scales and zeros of the wrong output columns (either layout)
    monkeypatch.setattr(kernels, "_CHECKED", {})
    with caplog.at_level("WARNING", logger="ember"):
        assert not broken._self_check(qt, torch.device("cpu"))
    assert "self-check FAILED" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_cuda_quantized_matmul_matches_dense_matmul_of_the_dequantized_weight(method, rows):
    qt = _weight(method, "cuda")
    x = torch.randn(rows, 256, device="cuda")
    ref = x @ qt.dequantize().t()
    mm = QuantizedMatmul(method, qt)
    if method != "int8":  # int8 has a CUDA kernel only in some torch builds
        assert mm.path == f"cuda-{method}"  # chosen, and its self-check passed
    y = mm(x.bfloat16()).float()
    tol = 0.05 if method == "w8a8" else 0.02
    assert ((y - ref).norm() / ref.norm()).item() < tol


def test_gguf_blocks_load_exactly_as_gguf_dequantizes_them():
    from gguf import GGMLQuantizationType, GGUFReader, dequantize, quantize

    reader = GGUFReader(default_gguf())
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("Q8_0", "Q4_1") and kind not in seen:
            seen.add(kind)
            qt = from_gguf(t.data, kind, (int(t.shape[1]), int(t.shape[0])))
            ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
            assert torch.equal(qt.dequantize(), ref.float()), kind
    assert seen == {"Q8_0", "Q4_1"}
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_0)
    ref = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType.Q4_0)))
    assert torch.equal(from_gguf(raw, "Q4_0", (64, 128)).dequantize(), ref)


@pytest.mark.parametrize("kind", ["int8", "uint4"])
def test_kv_entries_round_trip(kind):
    torch.manual_seed(2)
    x = torch.randn(5, 3, 64) * 4
    fmt = KVCacheFormat(kind, 64, torch.float32)
    packed = fmt.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, fmt.entry)
    back = fmt.unpack(packed, torch.float32)
    span = x.abs().amax(-1, keepdim=True) if kind == "int8" else (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True))
    if kind == "uint4":  # groups of 32
        g = x.view(5, 3, 2, 32)
        span = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)).expand(5, 3, 2, 32).reshape(5, 3, 64)
    step = span / (127 if kind == "int8" else 15)
    assert ((back - x).abs() <= step / 2 + 1e-5).all()
    assert fmt.unpack(torch.zeros_like(packed), torch.float32).eq(0).all()  # a zeroed pool reads as zeros
    assert KVCacheFormat("auto", 64, torch.bfloat16).bytes_per_entry() == 128
    assert fmt.bytes_per_entry() == {"int8": 68, "uint4": 48}[kind]


# ----- perplexity against float32 -----

PPL_TOKENS = 2500  # five windows of the chapter's first tokens: each mode on the real model in about half a minute


def _ids(llm) -> list[int]:
    with open(TEXT, encoding="utf-8") as f:
        return llm.get_tokenizer().encode(f.read())[:PPL_TOKENS]


MODES = {  # name -> LLM kwargs on top of float32: the modes with a bound below (benchmarks/quantization.py
    # measures every mode)
    "fp32": dict(quantization="none"),
    "int8": dict(quantization="int8"),
    "int4-g32": dict(quantization="int4", quant_group_size=32),
    "int4-g32-a8": dict(quantization="int4", quant_group_size=32, int8_activations=True),
    "kv-int8": dict(quantization="none", kv_cache_dtype="int8"),
    "kv-uint4": dict(quantization="none", kv_cache_dtype="uint4"),
}
WINDOW = 500  # tokens a window: with the one sampled token it fits the random models' 512 positions
# relative to fp32, from the issue (int4-g32-a8: int4's, with the activations' int8 rounding on top)
BOUNDS = {"int8": 0.01, "int4-g32": 0.08, "int4-g32-a8": 0.10, "kv-int8": 0.01, "kv-uint4": 0.10}


def _measure(model: str, **common) -> dict[str, tuple[float, list[list[int]]]]:
    results = {}
    for name, kw in MODES.items():
        args = dict(dtype="float32", max_num_seqs=16, max_model_len=512, max_num_batched_tokens=128,
                    enable_prefix_caching=False) | common | kw
        llm = LLM(model, **args)
        ppl = perplexity(llm, _ids(llm), window=WINDOW)
        greedy = [o.outputs[0].token_ids for o in
                  llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
        results[name] = (ppl, greedy)
        llm.shutdown()
    return results


def _check(results, label: str) -> None:
    base, base_greedy = results["fp32"]
    lines = [f"{label}: perplexity (relative to fp32), greedy agreement with fp32 over {len(PROMPTS)} prompts"]
    for name, (ppl, greedy) in results.items():
        agree = sum(a == b for a, b in zip(greedy, base_greedy))
        lines.append(f"  {name:11s} {ppl:10.3f} ({ppl / base - 1:+.2%})  {agree}/{len(PROMPTS)}")
    print("\n".join(lines))
    for name, bound in BOUNDS.items():
        assert abs(results[name][0] / base - 1) <= bound, f"{label} {name}: {results[name][0]} vs fp32 {base}"
    assert results["fp32"][0] < 1e4 or label != "SmolLM2"  # the real model reads English


def test_perplexity_of_every_mode_on_the_default_model():
    _check(_measure(default_gguf()), "SmolLM2")


def test_perplexity_of_every_mode_on_a_random_initialised_model(llama_dir):
    _check(_measure(llama_dir), "random llama")


# ----- footprint -----

def _weight_bytes(llm) -> tuple[int, int]:
    """(all weight bytes, bytes of the decoder's linear weights), each tensor counted once."""
    from ember.layers.linear import Linear

    model = worker_of(llm).loaded.model
    seen, total, linear = set(), 0, 0
    for module in model.modules():
        held = list(module.parameters(recurse=False))
        if getattr(module, "qmm", None) is not None:
            held += module.qmm.tensors()
        if getattr(module, "qt", None) is not None:
            held += [t for t in (module.qt.data, module.qt.scales, module.qt.offsets) if t is not None]
        for t in held:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n = t.numel() * t.element_size()
                total += n
                if isinstance(module, Linear) and t is not getattr(module, "bias", None):
                    linear += n
    return total, linear


def test_default_model_keeps_its_gguf_footprint_and_int4_is_under_0_3x_of_bf16():
    from ember.dtypes import cpu_has_fast_bf16

    # the embedded Q4_1 GGUF, dtype auto: bf16 with the GGUF's blocks kept where the CPU has fast bf16; a CPU
    # without it (AVX2) runs float32 dequantized by default, and keeps the blocks when asked for bf16
    llm = LLM(max_num_seqs=2, max_model_len=256, **({} if cpu_has_fast_bf16() else {"dtype": "bfloat16"}))
    quant = worker_of(llm).loaded.model.quant
    assert quant is not None and quant.method == "int4" and quant.group_size == 32 and quant.embeddings
    total, g32 = _weight_bytes(llm)
    assert total < 110 * 2**20, total  # the .gguf file is 94 MiB; dequantized to bf16 it is 270 MiB
    llm.shutdown()
    llm = LLM(max_num_seqs=2, max_model_len=256, quantization="int4", quant_group_size=128)
    g128 = _weight_bytes(llm)[1]
    llm.shutdown()
    llm = LLM(max_num_seqs=2, max_model_len=256, quantization="none", dtype="bfloat16")
    bf16 = _weight_bytes(llm)[1]
    llm.shutdown()
    # 4 bits a weight plus a 16-bit scale and zero per group: 4.25 bits at g128, 5 bits at g32 (0.31x)
    assert g128 <= 0.3 * bf16 and g32 <= 0.32 * bf16, (g128 / bf16, g32 / bf16)


def test_quantized_layers_replace_the_float_weights(llama_dir):
    from ember.layers.linear import Linear

    llm = LLM(llama_dir, quantization="int8", max_num_seqs=2, max_model_len=128)
    layers = [m for m in worker_of(llm).loaded.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight is None and m.qmm is not None for m in layers)
    llm.shutdown()


# ----- surfaces -----

@pytest.mark.parametrize("kwargs, field", [
    (dict(quantization="int3"), "quantization='int3'"),
    (dict(quantization="int4", quant_group_size=48), "quant_group_size=48"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
])
def test_bad_quantization_settings_fail_before_loading(llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        LLM(llama_dir, **kwargs)


def test_convert_stores_int4_and_loads_back_to_the_same_tokens(llama_dir, tmp_path):
    from ember.entrypoints.cli import main

    assert main(["convert", llama_dir, str(tmp_path / "q.asmodel"), "--quantization", "int4",
                 "--group-size", "32"]) == 0
    meta = json.loads((tmp_path / "q.asmodel").read_text())
    assert meta["quant_config"] == {"method": "int4", "group_size": 32, "embeddings": False}
    tensors = meta["weights"]["tensors"]
    assert tensors["model.layers.0.mlp.down_proj.qdata"] == ["uint8", [64, 64]]
    assert tensors["model.layers.0.mlp.down_proj.scales"][1] == [64, 4]
    assert "model.layers.0.mlp.down_proj.weight" not in tensors
    params = SamplingParams(temperature=0, max_tokens=12)
    stored = LLM(str(tmp_path / "q.asmodel"), dtype="float32", max_num_seqs=2, max_model_len=128)
    assert worker_of(stored).loaded.model.quant.describe() == "int4 g32"
    a = [o.outputs[0].token_ids for o in stored.generate(PROMPTS[:4], params, use_tqdm=False)]
    stored.shutdown()
    live = LLM(llama_dir, dtype="float32", quantization="int4", quant_group_size=32, max_num_seqs=2,
               max_model_len=128)
    b = [o.outputs[0].token_ids for o in live.generate(PROMPTS[:4], params, use_tqdm=False)]
    live.shutdown()
    assert a == b
    with pytest.raises(ValueError, match="stored quantized as int4 g32"):
        LLM(str(tmp_path / "q.asmodel"), quantization="int8")


def test_dashinfer_quantization_switches(llama_dir, tmp_path):
    from ember.compat.dashinfer.allspark import AsCacheMode, TargetDevice
    from ember.compat.dashinfer.allspark.engine import Engine, engine_config
    from ember.compat.dashinfer.allspark.model_loader import HuggingFaceModel, quant_config_from_recipe

    assert quant_config_from_recipe(True, True, None) == QuantConfig("int8")
    assert quant_config_from_recipe(True, False, None) == QuantConfig("w8a8")
    assert quant_config_from_recipe(True, True, {"weight_format": "uint4", "group_size": 64}) == QuantConfig("int4", 64)
    assert quant_config_from_recipe(False, True, {"weight_format": "uint4"}) is None
    with pytest.raises(ValueError, match="unknown key 'bits'"):
        quant_config_from_recipe(True, True, {"bits": 4})
    with pytest.raises(ValueError, match="weight_format='uint4' needs weight_only_quant=True"):
        quant_config_from_recipe(True, False, {"weight_format": "uint4"})

    loader = HuggingFaceModel(llama_dir, "tq", user_set_data_type="float32")
    loader.load_model().serialize_to_path(None, str(tmp_path), enable_quant=True, weight_only_quant=True,
                                          customized_quant_config={"weight_format": "uint4", "group_size": 64})
    meta = json.loads((tmp_path / "tq.asmodel").read_text())
    assert meta["quant_config"]["method"] == "int4" and meta["quant_config"]["group_size"] == 64
    recipe = meta["extra"]["dashinfer"]["serialize"]
    assert recipe["customized_quant_config"] == {"weight_format": "uint4", "group_size": 64}
    cfg = loader.create_reference_runtime_config_builder("tq", TargetDevice.CPU, [0], max_batch=2) \
        .max_length(128).kv_cache_mode(AsCacheMode.AsCacheQuantU4).build()
    assert engine_config(cfg).kv_cache_dtype == "uint4"
    engine = Engine()
    engine.install_model(cfg)
    engine.start_model("tq")
    native = engine._models["tq"].engine
    worker = worker_of(native)
    assert worker.kv_format.kind == "uint4" and worker.loaded.model.quant.method == "int4"
    engine.stop_model("tq")
    engine.release_model("tq")


def test_int8_activations_taken_by_no_weight_warns_and_keeps_the_configs_words(llama_dir, monkeypatch, caplog):
    """int8_activations=True where no weight can take them (here the int4 / int8 paths told so; on a CPU without
    AVX512-BF16 + VNNI + VBMI, or with AMX running the weights, the same happens): the load says so by name, and
    model_info.quantization keeps the configuration's words rather than a list of held kinds."""
    from ember.quantization import kernels as qk

    monkeypatch.setattr(qk.CpuInt4Path, "takes_int8_x", False)
    monkeypatch.setattr(qk.CpuInt8Path, "takes_int8_x", False)
    with caplog.at_level("WARNING", logger="ember"):
        llm = LLM(llama_dir, dtype="bfloat16", quantization="int4", int8_activations=True, kv_cache_memory="16MiB")
    try:
        assert llm.model_info.quantization == "int4 g128"
        assert "int8_activations=True is taken by no weight of this model" in caplog.text
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
