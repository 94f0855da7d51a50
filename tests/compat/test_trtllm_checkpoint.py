"""TensorRT-LLM checkpoints (config.json + rank{N}.safetensors): written from tiny random Llamas by
tests/trtllm_checkpoint.py (TensorRT-LLM's names and split rules, apart from the reader), read back into the
Hugging Face tensors exactly, run to the greedy tokens of the Hugging Face folder and of transformers, split over
ranks, and refused clearly when ember cannot read them."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import hf_float32, hf_greedy, random_prompts, save_random_model
from trtllm_checkpoint import write_trtllm_checkpoint

from ember import LLM, SamplingParams
from ember.distributed import ParallelContext, WeightSlice
from ember.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
VOCAB = 999  # odd: a tp_size=2 checkpoint pads lm_head to 1000 rows and the reader trims them
# name -> LlamaConfig switches: tied without biases (the converter copies the embedding into lm_head), untied with
# attention and MLP biases (every bias name of the format)
MODELS = {
    "tied": dict(tie_word_embeddings=True),
    "untied-bias": dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_theta=500000.0),
}


def _make_llama(kind: str, out_dir: str, tokenizer_dir: str) -> str:
    # biases start at zero: bias_std makes them count
    return save_random_model("LlamaConfig", out_dir, tokenizer_dir, seed=7, bias_std=0.3, vocab_size=VOCAB,
                             num_attention_heads=4, num_key_value_heads=2, **MODELS[kind])


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


@pytest.mark.parametrize("kind,layout", [(k, lay) for k in MODELS for lay in LAYOUTS
                                         if k == "tied" or not LAYOUTS[lay][2].get("share_embedding_table")])
def test_rank_files_join_back_into_the_hugging_face_tensors(llamas, tmp_path, kind, layout):
    """Every layout reads back bit for bit, whole and through a selector's slices (only a tied model is exported
    without lm_head)."""
    from transformers import AutoConfig

    from ember.model_loader import TRTLLMCheckpoint, open_checkpoint

    tp, pp, options = LAYOUTS[layout]
    src = llamas[kind]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), tp, pp, **options)
    assert sorted(os.listdir(ckpt_dir)) == ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]
    ckpt = open_checkpoint(ckpt_dir)
    assert isinstance(ckpt, TRTLLMCheckpoint)
    config, ref = ckpt.hf_config(), AutoConfig.from_pretrained(src)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "mlp_bias", "hidden_act",
                "max_position_embeddings"):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config.architectures == ["LlamaForCausalLM"] and config.dtype == torch.float32
    want = _hf_tensors(src)
    tied_out = options.get("share_embedding_table", False)
    assert config.tie_word_embeddings == tied_out
    if kind == "tied":
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
    for algo in ("W8A16", "W4A16_AWQ", "FP8"):
        ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / algo), 1, quant_algo=algo)
        _copy_tokenizer(src, ckpt_dir)
        with pytest.raises(ConfigError, match=rf"quant_algo='{algo}'.*unquantized.*quantization='int8' or 'int4'"):
            LLM(ckpt_dir, dtype="float32", device="cpu", kv_cache_memory="16MiB")
        with pytest.raises(ConfigError, match=algo):
            open_checkpoint(ckpt_dir).native_quantization()
    other = write_trtllm_checkpoint(src, str(tmp_path / "gpt"), 1)
    _edit_config(other, architecture="GPTForCausalLM")
    with pytest.raises(ConfigError, match=r"architecture='GPTForCausalLM' is not supported.*LlamaForCausalLM"):
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
    (engine / "config.json").write_text(json.dumps({"version": "0.10.0", "pretrained_config": {}, "build_config": {}}))
    (engine / "rank0.engine").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="built TensorRT-LLM engine"):
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


def test_a_kv_cache_quantization_scale_is_ignored_and_the_float_weights_load(llamas, tmp_path, caplog):
    src = llamas["tied"]
    ckpt_dir = write_trtllm_checkpoint(src, str(tmp_path / "trt"), 1, kv_cache_quant_algo="INT8")
    prompts = random_prompts(2, 5, 20, VOCAB, seed=13)
    want = [hf_greedy(hf_float32(src), p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(ckpt_dir, tokenizer=src, dtype="float32", device="cpu", kv_cache_memory="16MiB")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    finally:
        llm.shutdown()
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
