"""Shared fixtures: tiny random-initialised checkpoints of every supported architecture, saved with
transformers' own ``save_pretrained``, and the real default model (SmolLM2-135M-Instruct GGUF)."""

from __future__ import annotations

import os

import pytest
import torch

# under pytest-xdist the workers share the CPUs: each takes its share, and so do the processes its tests start
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
torch.set_num_threads(_THREADS)
# tests that look inside an engine (tests/internals.py) need its core in this process, the default on CPU only; the
# core's own process (CUDA's default) is tested on every device by tests/e2e/test_core_process.py
os.environ.setdefault("EMBER_ENGINE_CORE_PROCESS", "0")
# a model mapped from the prepared cache would skip what a test patches into the load (kernel choices, checks):
# off here, on in the tests of the cache itself (tests/*/test_prepared*.py)
os.environ.setdefault("EMBER_PREPARED_CACHE", "0")

VOCAB_TOKENIZER_DIR = "tokenizer"
TESTS = os.path.dirname(os.path.abspath(__file__))  # tests/: data/, the scripts and helper modules
SLOW_TIERS = ("e2e", "compat")  # engines, models, processes: everything above tests/unit


def pytest_collection_modifyitems(config, items) -> None:
    """The pyramid's upper tiers are ``slow``: every test in tests/e2e and tests/compat builds an engine, loads a
    model or starts processes. ``pytest -m "not slow"`` runs tests/unit alone, in seconds."""
    for item in items:
        if os.path.relpath(str(item.path), TESTS).split(os.sep)[0] in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def avx512():
    """The AVX512-BF16 kernels: this machine's, or emulated where it has no AVX-512 (a test file needing more of
    the CPU, VBMI say, defines its own)."""
    from ember.kernels import cpu_kernels, emulated_kernels

    k = cpu_kernels()
    if k is None:
        pytest.skip("the CPU kernels could not be built on this machine")
    return k if k.has_avx512_bf16() else emulated_kernels()


def default_gguf() -> str:
    from ember.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The default model's tokenizer (vocabulary of 49,152) saved as a Hugging Face tokenizer folder."""
    from ember.tokenizer import Tokenizer

    path = default_gguf()
    out = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.load(path, gguf_file=path).hf.save_pretrained(out)
    return str(out)


# name -> (config class, kwargs): together they cover GQA and MHA, tied and untied embeddings, qkv bias, q/k norm,
# sliding window.
TINY = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4,
                                             tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=48,
                                      tie_word_embeddings=False)),
}


def save_random_model(config_class: str, out_dir: str, tokenizer_dir: str, seed: int = 0,
                      bias_std: float | None = None, **overrides) -> str:
    """A random-initialised model of a transformers config class, saved with its tokenizer: hidden 64, MLP 128, two
    layers, the tokenizer's vocabulary and BOS / EOS, peaked distributions; overrides replace any of those. bias_std:
    draw the biases (zero at init) from N(0, bias_std), so that code handling them is exercised."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id,
                    initializer_range=0.3)  # peaked distributions: greedy parity is not decided by rounding noise
    config = getattr(transformers, config_class)(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if bias_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, bias_std)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def edited_copy(src, dst, file: str, **changes):
    """A copy of the model folder src at dst whose JSON file ``file`` has these keys changed: a checkpoint that
    lies, or whose processor does not match its model."""
    import json
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, file)
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)
    return dst


def make_tiny_model(kind: str, out_dir: str, tokenizer_dir: str, seed: int = 0, max_position: int = 512) -> str:
    cls_name, extra = TINY[kind]
    return save_random_model(cls_name, out_dir, tokenizer_dir, seed, max_position_embeddings=max_position, **extra)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {k: make_tiny_model(k, str(tmp_path_factory.mktemp(k)), tokenizer_dir) for k in TINY}


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def tiny_llm(llama_dir):
    from ember import LLM

    llm = LLM(llama_dir, dtype="float32", max_num_seqs=64, kv_cache_memory="64MiB")
    yield llm
    llm.shutdown()


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (n,), generator=g).tolist()
    # skip the first ids: special tokens of the tokenizer
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for length in lens]


def hf_float32(path: str, **kw):
    """transformers' model of a checkpoint in float32, eval mode: the reference every parity test compares to."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens, EOS not special (like ignore_eos=True), with its own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def peft_adapter(model_dir: str, out: str, seed: int = 0, **lora) -> dict[str, torch.Tensor]:
    """A random (non-zero B) PEFT adapter of the model in model_dir, saved to out; PEFT's state dict."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    settings = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, LoraConfig(**{**settings, **lora}))
    peft_model.save_pretrained(out)
    return {k: v.detach().clone() for k, v in peft_model.state_dict().items() if "lora_" in k}


def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], n: int,
                gguf_file: str | None = None) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, float32, with the PEFT adapter at ``adapter`` (None: without)."""
    from peft import PeftModel

    model = hf_float32(model_dir, **({"gguf_file": gguf_file} if gguf_file else {}))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_greedy(model, p, n) for p in prompts]


@pytest.fixture(scope="module")
def api(server):
    """The openai client on the module's ``server`` fixture (a running ``ember serve``)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(api) -> str:
    """The first name the module's server answers to."""
    return api.models.list().data[0].id
