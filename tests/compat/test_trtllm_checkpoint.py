"""TensorRT-LLM checkpoints (config.json + rank{N}.safetensors): written from tiny random Llamas, Qwen2s and
Mistrals by tests/trtllm_checkpoint.py (TensorRT-LLM's names, split rules and quantized layouts, apart from the
reader), read back into the Hugging Face tensors exactly (quantized ones into exactly their dequantized values), run
to the greedy tokens of the Hugging Face folder and of transformers, split over ranks, and refused clearly when
ember cannot read them."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import hf_float32, hf_greedy, random_prompts, save_random_model
from trtllm_checkpoint import quantized_linears, smoothquant_plugin_float_state, write_trtllm_checkpoint

from ember import LLM, SamplingParams
from ember.distributed import ParallelContext, WeightSlice
from ember.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
VOCAB = 999  # odd: a tp_size=2 checkpoint pads lm_head to 1000 rows and the reader trims them
# name -> (config class, switches): Llama tied without biases (the converter copies the embedding into lm_head),
# Llama untied with attention and MLP biases (every bias name of the format), Qwen2 tied with its q/k/v biases (written
# as QWenForCausalLM, qwen_type 'qwen2'), Mistral untied with one KV head and no sliding window (the converter writes
# none)
MODELS = {
    "tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "untied-bias": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                        rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, num_key_value_heads=1, sliding_window=None)),
}


def _make_llama(kind: str, out_dir: str, tokenizer_dir: str) -> str:
    # biases start at zero: bias_std makes them count
    cls, switches = MODELS[kind]
    return save_random_model(cls, out_dir, tokenizer_dir, seed=7, bias_std=0.3, vocab_size=VOCAB,
                             **{"num_attention_heads": 4, "num_key_value_heads": 2, **switches})


@pytest.fixture(scope="module")
def llamas(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {k: _make_llama(k, str(tmp_path_factory.mktemp(k)), tokenizer_dir) for k in MODELS}


def _hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _copy_tokenizer(src: str, dst: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), dst)


# (tp, pp, writer options): KV heads repeated (tp 4 > 2 KV heads), stages, both embedding shardings, no lm_head
LAYOUTS = {
    "tp1": (1, 1, {}),
    "tp2": (2, 1, {}),
    "tp4-repeated-kv": (4, 1, {}),
    "tp2-pp2": (2, 2, {}),
    "tp2-embedding-vocab": (2, 1, dict(use_parallel_embedding=True, embedding_sharding_dim=0)),
    "tp2-embedding-hidden": (2, 1, dict(use_parallel_embedding=True, embedding_sharding_dim=1)),
    "tp2-shared-embedding": (2, 1, dict(share_embedding_table=True)),
}


TIED = [k for k in MODELS if MODELS[k][1]["tie_word_embeddings"]]


@pytest.mark.parametrize("kind,layout", [(k, lay) for k in MODELS for lay in LAYOUTS
                                         if k in TIED or not LAYOUTS[lay][2].get("share_embedding_table")])
def test_rank_files_join_back_into_the_hugging_face_tensors(llamas, tmp_path, kind, layout):
    """Every layout reads back bit for bit, whole and through a selector's slices (only a tied model is exported
    without lm_head)."""
    from transformers import AutoConfig

    from ember.config import ModelShape
    from ember.model_loader import TRTLLMCheckpoint, open_checkpoint

    tp, pp, options = LAYOUTS[layout]
    src = llamas[kind]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, pp, **options)
    assert sorted(os.listdir(ckpt_dir)) == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    ckpt = open_checkpoint(ckpt_dir)
    assert isinstance(ckpt, TRTLLMCheckpoint)
    config, ref = ckpt.hf_config(), AutoConfig.from_pretrained(src)
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "attention_bias", "mlp_bias",
                "hidden_act", "max_position_embeddings", "sliding_window", "use_sliding_window"):
        assert getattr(config, key, None) == getattr(ref, key, None), key
    assert ModelShape.of(config) == ModelShape.of(ref)
    assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config.architectures == ref.architectures and config.dtype == torch.float32
    want = _hf_tensors(src)
    tied_out = options.get("share_embedding_table", False)
    assert config.tie_word_embeddings == tied_out
    if kind in TIED:
        want.pop("lm_head.weight", None)
        if not tied_out:  # the converter wrote the embedding as lm_head
            want["lm_head.weight"] = want["model.embed_tokens.weight"]
    got = dict(ckpt.tensors(config))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # a selector's slice of each tensor: rows and columns across the ranks' boundaries, the vocabulary's end
    for dim, start, stop in ((0, 5, 50), (0, 60, 70), (0, 990, 999), (1, 3, 40), (1, 30, 34)):
        def select(name, dim=dim, start=start, stop=stop):
            if name.endswith("norm.weight") or dim >= want[name].dim() or stop > want[name].shape[dim]:
                return None if name.endswith("q_proj.weight") else WeightSlice()
            return WeightSlice(dim, start, stop)

        seen = set()
        for name, t in ckpt.tensors(config, select=select):
            seen.add(name)
            assert torch.equal(t, select(name).apply(want[name])), (name, dim, start, stop)
        assert seen == {n for n in want if select(n) is not None}


@pytest.mark.parametrize("layout", ["tp2", "tp2-pp2", "tp4-repeated-kv"])
def test_each_rank_of_a_split_engine_holds_what_it_holds_from_the_hugging_face_folder(llamas, tmp_path, layout):
    """The model's own weight_slice drives the reader: a T=2 or P=2 rank built from the TensorRT-LLM checkpoint has
    exactly the parameters of the same rank built from the Hugging Face folder."""
    from ember.config import EngineConfig
    from ember.model_loader import load_model

    tp, pp, options = LAYOUTS[layout]
    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, pp, **options)
    for ctx in (ParallelContext(tp_size=2, tp_rank=1), ParallelContext(pp_size=2, pp_rank=1)):
        models = [load_model(EngineConfig(p, dtype="float32", device="cpu").resolve().model, ctx).model
                  for p in (src, ckpt_dir)]
        want, got = (dict(m.named_parameters()) for m in models)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (ctx, name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", MODELS)
def test_greedy_tokens_match_the_hugging_face_folder_and_transformers(llamas, tmp_path, kind, tp):
    src = llamas[kind]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp)
    prompts = random_prompts(3, 5, 30, VOCAB, seed=11)
    ref = hf_float32(src)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    got = {}
    for name, path, options in (("hf", src, {}), ("trt", ckpt_dir, dict(tokenizer=src))):
        llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory="16MiB", **options)
        try:
            got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert got["trt"] == got["hf"] == want


@pytest.mark.parametrize("layout", ["tp2", "tp2-pp2"])
def test_a_split_engine_on_a_sharded_checkpoint_gives_the_same_tokens(llamas, tmp_path, layout):
    """tensor_parallel_size=2 over spawned ranks (mp), from a checkpoint converted for tp_size=2, and one converted
    for tp_size=2 x pp_size=2 (its stages' files merged)."""
    tp, pp, options = LAYOUTS[layout]
    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, pp, **options)
    _copy_tokenizer(src, ckpt_dir)
    prompts = random_prompts(3, 5, 30, VOCAB, seed=12)
    ref = hf_float32(src)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(ckpt_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB", tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        assert llm.model_info.executor == "mp"
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    finally:
        llm.shutdown()


def test_tokenizer_comes_from_the_folder_or_the_tokenizer_argument(llamas, tmp_path):
    src = llamas["tied"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 2)
    with pytest.raises(ConfigError, match=r"no tokenizer files.*pass tokenizer=<folder>"):
        LLM(ckpt_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name, options in (("argument", dict(tokenizer=src)), ("folder", {})):
        if name == "folder":
            _copy_tokenizer(src, ckpt_dir)
        llm = LLM(ckpt_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB", **options)
        try:
            out = llm.generate([[100, 200, 300, 400]], params, use_tqdm=False)[0]  # text would pass the vocabulary
            outs[name] = (out.outputs[0].token_ids, out.outputs[0].text)
        finally:
            llm.shutdown()
    assert outs["argument"] == outs["folder"] and outs["folder"][1]  # detokenized by the same tokenizer


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_checkpoints_ember_cannot_read_are_refused_clearly(llamas, tmp_path):
    from ember.model_loader import open_checkpoint, read_shape

    src = llamas["tied"]
    # the quant_algos read are tested below; these are refused before any weight is read, the algo named
    reasons = {"FP8": "FP8 weights", "W8A8_SQ_PER_TENSOR": "a SmoothQuant variant ember does not read",
               "W4A16_GPTQ": "a layout ember does not read"}
    for algo, reason in reasons.items():
        ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / algo), 1, quant_algo=algo)
        _copy_tokenizer(src, ckpt_dir)
        with pytest.raises(ConfigError, match=rf"quant_algo='{algo}': {reason}.*W4A16_AWQ.*quantization='int8'"):
            LLM(ckpt_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB")
        with pytest.raises(ConfigError, match=algo):
            open_checkpoint(ckpt_dir).native_quantization()
    zero = write_trtllm_checkpoint(src, str(tmp_path / "zero"), 1, quant_algo="W4A16_AWQ", group_size=32)
    _edit_config(zero, quantization={"quant_algo": "W4A16_AWQ", "group_size": 32, "has_zero_point": True})
    with pytest.raises(ConfigError, match="has_zero_point=True"):
        read_shape(zero)
    qwen = write_trtllm_checkpoint(llamas["qwen2"], str(tmp_path / "qwen1"), 1)
    _edit_config(qwen, qwen_type="qwen")
    with pytest.raises(ConfigError, match=r"architecture='QWenForCausalLM' with qwen_type='qwen' .*Qwen \(v1\)"):
        read_shape(qwen)
    other = write_trtllm_checkpoint(src, str(tmp_path / "gpt"), 1)
    _edit_config(other, architecture="GPTForCausalLM")
    with pytest.raises(ConfigError, match=r"architecture='GPTForCausalLM' is not supported.*LlamaForCausalLM.*"
                                          r"MistralForCausalLM.*QWenForCausalLM"):
        read_shape(other)
    interleaved = write_trtllm_checkpoint(src, str(tmp_path / "gptj"), 1)
    _edit_config(interleaved, position_embedding_type="rope_gptj")
    with pytest.raises(ConfigError, match="position_embedding_type='rope_gptj'"):
        read_shape(interleaved)
    missing = write_trtllm_checkpoint(src, str(tmp_path / "missing"), 2)
    os.remove(os.path.join(missing, "rank1.safetensors"))
    with pytest.raises(ConfigError, match=r"tp_size=2 .* lacks \['rank1.safetensors'\]"):
        read_shape(missing)
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({
        "version": "0.11.0", "pretrained_config": {"architecture": "QWenForCausalLM", "dtype": "bfloat16"},
        "build_config": {"max_batch_size": 4, "max_input_len": 100, "max_seq_len": 300}}))
    (engine / "rank0.engine").write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"engine built by trtllm-build \(TensorRT-LLM 0.11.0\).*rank0.engine.*cannot "
                                          r"be recovered.*config.json \+ rank0.safetensors, architecture="
                                          r"'QWenForCausalLM', dtype='bfloat16'.*built for max_batch_size=4, "
                                          r"max_input_len=100, max_output_len=200: set them with max_num_seqs="):
        LLM(str(engine))


def test_kinds_are_told_apart_and_the_limits_read_from_the_config(llamas, tmp_path):
    from ember.config import EngineConfig
    from ember.model_loader import HFCheckpoint, check_parallel, open_checkpoint, read_shape

    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 2)
    assert isinstance(open_checkpoint(src), HFCheckpoint)
    assert read_shape(ckpt_dir) == read_shape(src)
    config = EngineConfig(ckpt_dir, dtype="float32", device="cpu").resolve().model
    assert config.path == ckpt_dir
    check_parallel(config, 2, 2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 is out of range.*allowed: \[1, 2, 4\]"):
        check_parallel(config, 3, 1)
    half = write_trtllm_checkpoint(src, str(tmp_path / "fp16"), 1, dtype="float16")
    assert open_checkpoint(half).hf_config().dtype == torch.float16
    assert next(open_checkpoint(half).tensors(open_checkpoint(half).hf_config()))[1].dtype == torch.float16
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 128}
    _edit_config(half, rotary_scaling=scaled, rotary_base=123.0)
    assert open_checkpoint(half).hf_config().rope_parameters == dict(scaled, rope_theta=123.0)


def _greedy_like_transformers(ckpt_dir: str, tokenizer: str, reference: str, n: int, max_len: int, seed: int) -> None:
    """The checkpoint's float32 greedy tokens in ember equal transformers' on the reference Hugging Face folder."""
    prompts = random_prompts(n, 5, max_len, VOCAB, seed=seed)
    ref = hf_float32(reference)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(ckpt_dir, tokenizer=tokenizer, dtype="float32", device="cpu", kv_cache_memory="16MiB")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    finally:
        llm.shutdown()


def test_a_kv_cache_quantization_scale_is_ignored_and_the_float_weights_load(llamas, tmp_path, caplog):
    src = llamas["tied"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 1, kv_cache_quant_algo="INT8")
    _greedy_like_transformers(ckpt_dir, src, src, 2, 20, seed=13)
    assert "kv_cache_quant_algo='INT8' is ignored" in caplog.text


def test_a_folder_of_no_format_names_every_accepted_format(tmp_path):
    formats = ("a Hugging Face folder, a TensorRT-LLM checkpoint folder, a .gguf file, an .asmodel file, or a folder "
               "with one .gguf/.asmodel")
    (tmp_path / "rank0.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path))
    assert "has no config.json" in str(e.value) and formats in str(e.value)
    with pytest.raises(ConfigError) as e:
        LLM(str(tmp_path / "nowhere"))
    assert "does not exist" in str(e.value) and formats in str(e.value)


# ---------------------------------------------------------------- families


def test_the_family_names_of_the_converters_build_their_ember_models(llamas, tmp_path):
    """Qwen2 as v0.12 names it (Qwen2ForCausalLM), InternLM (a Llama with q/k/v/o biases), and a Mistral whose
    config.json carries a sliding window: each built as ember's family, the tensors as the Hugging Face folder's."""
    from ember.model_loader import open_checkpoint

    cases = {  # source kind, architecture written -> the architecture and model_type built
        "qwen2-v12": ("qwen2", "Qwen2ForCausalLM", "Qwen2ForCausalLM", "qwen2"),
        "internlm": ("untied-bias", "InternLMForCausalLM", "LlamaForCausalLM", "llama"),
    }
    for name, (kind, written, built, model_type) in cases.items():
        ckpt_dir = write_trtllm_checkpoint(llamas[kind], str(tmp_path / name), 2, architecture=written)
        ckpt = open_checkpoint(ckpt_dir)
        config = ckpt.hf_config()
        assert config.architectures == [built] and config.model_type == model_type, name
        got, want = dict(ckpt.tensors(config)), _hf_tensors(llamas[kind])
        want.setdefault("lm_head.weight", want["model.embed_tokens.weight"])
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), name
    assert open_checkpoint(str(tmp_path / "internlm")).hf_config().attention_bias
    mistral = write_trtllm_checkpoint(llamas["mistral"], str(tmp_path / "mistral"), 1)
    assert open_checkpoint(mistral).hf_config().sliding_window is None
    _edit_config(mistral, sliding_window=48)
    assert open_checkpoint(mistral).hf_config().sliding_window == 48
    qwen = write_trtllm_checkpoint(llamas["qwen2"], str(tmp_path / "qwen-bias"), 1)
    _edit_config(qwen, mlp_bias=True)
    with pytest.raises(ConfigError, match=r"mlp_bias=True \(Qwen2's MLP has no biases\)"):
        open_checkpoint(qwen).hf_config()


# ---------------------------------------------------------------- quantized checkpoints

GROUP = 16  # AWQ groups: the tiny models' 64 and 128 inputs, and their tp_size=4 shares, hold whole groups
_PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _dequantized(src: str, algo: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The float weights a ModelOpt checkpoint written from src stands for, computed here from the writer's integers
    and scales: q * scale (each group's, AWQ; each row's, SmoothQuant) * prequant, in float32, rounded once to the
    dtype; every other tensor as the Hugging Face folder holds it, in the dtype."""
    from transformers import AutoConfig

    state = {k: v.to(dtype) for k, v in _hf_tensors(src).items()}
    layers = AutoConfig.from_pretrained(src).num_hidden_layers
    for name, ql in quantized_linears(state, algo, GROUP, dtype, layers).items():
        scale = ql.scale.float()
        scale = scale.repeat_interleave(GROUP, dim=1) if algo in ("W4A16_AWQ", "W4A16") else scale[:, None]
        step = scale * ql.prequant.float()[None, :]
        original = state[name].float()
        state[name] = ((ql.q.float() * scale) * ql.prequant.float()[None, :]).to(dtype)
        # the writer stored round(W / prequant / scale): within half a step of W (and the dtype's rounding)
        assert ((state[name].float() - original).abs() <= step / 2 + original.abs() / 64 + 1e-6).all(), name
    return state


def _hf_folder_with(src: str, out: str, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    shutil.copytree(src, out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    return out


QUANT_LAYOUTS = ["tp1", "tp2", "tp4-repeated-kv", "tp2-pp2"]


def _assert_reads_exactly(ckpt, config, want: dict, slices) -> None:
    """The checkpoint reads every tensor of ``want`` with its dtype and values, whole and cut by each
    (dim, start, stop) of ``slices`` (a tensor too small or of too few dims for one is read whole)."""
    got = dict(ckpt.tensors(config))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    for dim, start, stop in slices:
        def select(name, dim=dim, start=start, stop=stop):
            if dim >= want[name].dim() or stop > want[name].shape[dim]:
                return WeightSlice()
            return WeightSlice(dim, start, stop)

        for name, t in ckpt.tensors(config, select=select):
            assert torch.equal(t, select(name).apply(want[name])), (name, dim, start, stop)


@pytest.mark.parametrize("algo,layout,dtype", [(a, lay, "float32") for a in ("W4A16_AWQ", "W8A8_SQ_PER_CHANNEL")
                                               for lay in QUANT_LAYOUTS] + [("W4A16_AWQ", "tp2", "bfloat16")])
def test_modelopt_quantized_weights_read_back_as_their_dequantized_values(llamas, tmp_path, algo, layout, dtype):
    """Every tensor equals the dequantized value computed from the writer's integers, whole and through a
    selector's slices (rows across packed int4 pairs and the ranks' boundaries, columns across groups)."""
    from ember.model_loader import open_checkpoint

    tp, pp, options = LAYOUTS[layout]
    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, pp, quant_algo=algo, group_size=GROUP,
                                       dtype=dtype, **options)
    with open(os.path.join(ckpt_dir, "rank0.safetensors"), "rb") as f:  # the layout really is quantized
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["transformer.layers.0.attention.qkv.weight"]["dtype"] == "I8"
    ckpt = open_checkpoint(ckpt_dir)
    assert ckpt.native_quantization() is None  # float: ember quantizes again only when asked
    config = ckpt.hf_config()
    want = _dequantized(src, algo, getattr(torch, dtype))
    _assert_reads_exactly(ckpt, config, want, ((0, 5, 51), (0, 63, 70), (1, 3, 40), (1, 31, 33)))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("algo", ["W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"])
def test_modelopt_quantized_checkpoints_give_the_tokens_of_their_dequantized_weights(llamas, tmp_path, algo, tp):
    """float32 greedy tokens of the checkpoint equal transformers' on a Hugging Face folder holding the same
    dequantized weights; tp=2: the checkpoint's shares, read by a T=2 rank, equal that folder's."""
    from ember.config import EngineConfig
    from ember.model_loader import load_model

    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, quant_algo=algo, group_size=GROUP)
    hf_dir = _hf_folder_with(src, str(tmp_path / "hf"), _dequantized(src, algo))
    _greedy_like_transformers(ckpt_dir, src, hf_dir, 3, 30, seed=14)
    if tp == 2:
        ctx = ParallelContext(tp_size=2, tp_rank=1)
        models = [load_model(EngineConfig(p, dtype="float32", device="cpu").resolve().model, ctx).model
                  for p in (hf_dir, ckpt_dir)]
        want_p, got_p = (dict(m.named_parameters()) for m in models)
        assert sorted(got_p) == sorted(want_p) and all(torch.equal(got_p[n], want_p[n]) for n in want_p)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16"])
def test_modelopt_weight_only_exports_give_the_tokens_of_their_dequantized_weights(llamas, tmp_path, algo):
    """ModelOpt's int8_wo / int4_wo export (its AWQ / SmoothQuant layout without a prequant scale) is not
    preprocessed: read back as q * scale, and the float32 greedy tokens equal transformers' on those weights."""
    from ember.model_loader import open_checkpoint

    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 2, quant_algo=algo, group_size=GROUP,
                                       weight_only_plugin="modelopt")
    want = _dequantized(src, algo)
    ckpt = open_checkpoint(ckpt_dir)
    got = dict(ckpt.tensors(ckpt.hf_config()))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    hf_dir = _hf_folder_with(src, str(tmp_path / "hf"), want)
    _greedy_like_transformers(ckpt_dir, src, hf_dir, 2, 30, seed=15)


def test_weight_only_checkpoints_load_when_their_weights_are_float_and_are_refused_when_preprocessed(llamas,
                                                                                                    tmp_path):
    """--disable_weight_only_quant_plugin keeps the float weights (transposed, [in, out]): read back exactly, and
    ember quantizes them only when asked. The plugin's int8 / int4 weights were preprocessed for the converting GPU:
    refused, saying why and what to pass instead."""
    from ember.config import EngineConfig
    from ember.model_loader import load_model, open_checkpoint

    src = llamas["untied-bias"]
    want = _hf_tensors(src)
    for algo in ("W8A16", "W4A16"):
        ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / f"{algo}-float"), 2, quant_algo=algo,
                                           weight_only_plugin=False)
        ckpt = open_checkpoint(ckpt_dir)
        assert ckpt.native_quantization() is None
        got = dict(ckpt.tensors(ckpt.hf_config()))
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), algo
        plugin = write_trtllm_checkpoint(src, str(tmp_path / algo), 2, quant_algo=algo)
        _copy_tokenizer(src, plugin)
        message = (rf"quant_algo='{algo}'.*preprocessed for the kernels of the GPU that converted them.*cannot be "
                   r"recovered\. Pass the Hugging Face folder .*, a checkpoint ModelOpt exported .*, or one "
                   r"converted with --disable_weight_only_quant_plugin")
        with pytest.raises(ConfigError, match=message):
            LLM(plugin, dtype="float32", device="cpu", kv_cache_memory="16MiB")
        with pytest.raises(ConfigError, match=message):
            open_checkpoint(plugin).native_quantization()
    loaded = load_model(EngineConfig(str(tmp_path / "W8A16-float"), dtype="bfloat16", device="cpu",
                                     quantization="int8").resolve().model)
    assert loaded.quant is not None and loaded.quant.method == "int8"


def test_quantized_layouts_ember_does_not_read_are_refused_clearly(llamas, tmp_path):
    """TensorRT-LLM's own SmoothQuant tensors under a ModelOpt algo name, and AWQ weights not in ModelOpt's
    [out/2, in] layout (as older converters preprocessed them, [in, out/2])."""
    from safetensors.torch import load_file, save_file

    from ember.model_loader import open_checkpoint

    src = llamas["tied"]
    sq = write_trtllm_checkpoint(src, str(tmp_path / "sq"), 1, quant_algo="W8A8_SQ_PER_CHANNEL")
    rank0 = os.path.join(sq, "rank0.safetensors")
    tensors = load_file(rank0)
    tensors["transformer.layers.0.attention.dense.smoother"] = torch.ones(64)
    save_file(tensors, rank0)
    with pytest.raises(ConfigError, match=r"quant_algo='W8A8_SQ_PER_CHANNEL', in TensorRT-LLM's own SmoothQuant "
                                          r"layout \(transformer.layers.0.attention.dense.smoother"):
        open_checkpoint(sq).hf_config()
    awq = write_trtllm_checkpoint(src, str(tmp_path / "awq"), 1, quant_algo="W4A16_AWQ", group_size=GROUP)
    rank0 = os.path.join(awq, "rank0.safetensors")
    tensors = load_file(rank0)
    key = "transformer.layers.1.mlp.proj.weight"
    tensors[key] = tensors[key].t().contiguous()  # [out/2, in] = [32, 128] -> [in, out/2]
    save_file(tensors, rank0)
    ckpt = open_checkpoint(awq)
    with pytest.raises(ConfigError, match=rf"rank0.safetensors {key} is I8 \[128, 32\].*not ModelOpt's W4A16_AWQ"):
        dict(ckpt.tensors(ckpt.hf_config()))


# ---------------------------------------------------------------- TensorRT-LLM's own SmoothQuant (plugin) layout


def _sq_plugin_float(src: str, algo: str) -> dict[str, torch.Tensor]:
    """The float weights of a SmoothQuant plugin checkpoint written from src, from the writer's integers, scales and
    smoothing (the smoothed layernorms as stored, q * per_channel_scale / smoother)."""
    from transformers import AutoConfig

    state = _hf_tensors(src)
    want = smoothquant_plugin_float_state(state, algo, AutoConfig.from_pretrained(src).num_hidden_layers)
    # the float model's function within the int8 rounding (10%: per tensor): each linear times the layernorm before
    # it (which holds its smoothing), o_proj / down_proj alone
    for name, t in want.items():
        if not name.endswith("proj.weight"):
            continue
        norm = "" if ("o_proj" in name or "down_proj" in name) else \
            "input_layernorm" if "self_attn" in name else "post_attention_layernorm"
        ln, ln_want = ((d[name.split(".self_attn")[0].split(".mlp")[0] + f".{norm}.weight"][None, :] if norm else 1.0)
                       for d in (state, want))
        assert (t * ln_want - state[name] * ln).norm() <= 0.1 * (state[name] * ln).norm(), name
    return want


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("algo", ["W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_TENSOR_PLUGIN"])
def test_smoothquant_plugin_weights_read_back_as_their_dequantized_values(llamas, tmp_path, algo, tp):
    """convert_checkpoint --smoothquant: int8 weights with per_channel_scale (and dense / proj's smoother) read
    back as q * scale / smoother, the smoothed layernorms as stored, the companions ignored; whole and sliced."""
    from safetensors.torch import load_file, save_file

    from ember.model_loader import open_checkpoint

    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, quant_algo=algo)
    rank0 = load_file(os.path.join(ckpt_dir, "rank0.safetensors"))
    assert rank0["transformer.layers.0.attention.qkv.weight"].dtype == torch.int8
    assert "transformer.layers.0.mlp.proj.smoother" in rank0 and "transformer.layers.0.mlp.fc.act_scale" in rank0
    assert "transformer.layers.0.input_layernorm.scale_to_int" in rank0
    ckpt = open_checkpoint(ckpt_dir)
    assert ckpt.native_quantization() is None
    config = ckpt.hf_config()
    want = _sq_plugin_float(src, algo)
    _assert_reads_exactly(ckpt, config, want, ((0, 5, 51), (1, 3, 40), (1, 31, 33)))
    if tp == 1:  # a per_channel_scale of the wrong shape, and an int8 weight without one: refused, saying why
        key = "transformer.layers.1.mlp.fc."
        bad = dict(rank0, **{key + "per_channel_scale": torch.ones(1, 7)})
        save_file(bad, os.path.join(ckpt_dir, "rank0.safetensors"))
        with pytest.raises(ConfigError, match=rf"{key}weight is I8 \[128, 64\] with per_channel_scale \[1, 7\].*"
                                              rf"not TensorRT-LLM's {algo} layout"):
            dict(open_checkpoint(ckpt_dir).tensors(config))
        del bad[key + "per_channel_scale"]
        save_file(bad, os.path.join(ckpt_dir, "rank0.safetensors"))
        with pytest.raises(ConfigError, match=rf"{key}weight is I8 without per_channel_scale"):
            open_checkpoint(ckpt_dir).hf_config()


def test_smoothquant_plugin_checkpoint_gives_the_tokens_of_its_dequantized_weights(llamas, tmp_path):
    algo = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    src = llamas["untied-bias"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 1, quant_algo=algo)
    hf_dir = _hf_folder_with(src, str(tmp_path / "hf"), _sq_plugin_float(src, algo))
    _greedy_like_transformers(ckpt_dir, src, hf_dir, 3, 30, seed=16)
