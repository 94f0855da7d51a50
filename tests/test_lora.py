"""LoRA adapters as PEFT writes them: the reader gives back PEFT's own A / B and scaling, and refuses by name what
ember cannot apply (the engine's use of adapters comes with the LoRA layers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ember.config import ModelShape
from ember.errors import BadRequestError
from ember.lora import LoRARequest, read_adapter, read_adapter_config


def _peft_adapter(model_dir: str, out: str, seed: int = 0, **lora) -> dict[str, torch.Tensor]:
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


def _shape(model_dir: str) -> tuple[ModelShape, int]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    return ModelShape.of(cfg), cfg.intermediate_size


def test_reads_peft_weights_and_scaling(llama_dir, tmp_path):
    state = _peft_adapter(llama_dir, str(tmp_path / "a"), rank_pattern={"down_proj": 4},
                          alpha_pattern={"layers.1.self_attn.q_proj": 4})
    shape, inter = _shape(llama_dir)
    adapter = read_adapter(str(tmp_path / "a"), "a", shape, inter, max_lora_rank=8)
    assert len(adapter.weights) == 7 * shape.num_layers and adapter.rank == 8
    for (layer, proj), w in adapter.weights.items():
        part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
        assert torch.equal(w.a, state[f"{prefix}.lora_A.default.weight"])
        assert torch.equal(w.b, state[f"{prefix}.lora_B.default.weight"])
    assert adapter.weights[(0, "q_proj")].scaling == 16 / 8
    assert adapter.weights[(0, "down_proj")].a.shape[0] == 4 and adapter.weights[(0, "down_proj")].scaling == 16 / 4
    assert adapter.weights[(1, "q_proj")].scaling == 4 / 8 and adapter.weights[(0, "q_proj")].scaling == 2


def test_bad_adapters_fail_by_name(llama_dir, tiny_models, tmp_path):
    shape, inter = _shape(llama_dir)
    good = str(tmp_path / "good")
    _peft_adapter(llama_dir, good, target_modules=["q_proj", "v_proj"])

    def read(path, max_rank=8):
        return read_adapter(path, "x", shape, inter, max_rank)

    with pytest.raises(BadRequestError, match="no such folder"):
        read(str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(BadRequestError, match="adapter_config.json is missing"):
        read(str(tmp_path / "empty"))
    with pytest.raises(BadRequestError, match="rank 8 is above max_lora_rank=4"):
        read(good, max_rank=4)
    for key, value, message in (("use_dora", True, "use_dora=True is not supported"),
                                ("bias", "all", "bias='all' is not supported"),
                                ("modules_to_save", ["lm_head"], "modules_to_save=.* is not supported"),
                                ("target_modules", ["q_proj", "embed_tokens"], r"\['embed_tokens'\] are not supported"),
                                ("peft_type", "IA3", "peft_type='IA3' is not supported")):
        with open(os.path.join(good, "adapter_config.json")) as f:
            cfg = json.load(f)
        cfg[key] = value
        bad = tmp_path / f"bad-{key}"
        os.makedirs(bad)
        os.link(os.path.join(good, "adapter_model.safetensors"), bad / "adapter_model.safetensors")
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(BadRequestError, match=message):
            read_adapter_config(str(bad), 8)
    other = str(tmp_path / "other")  # an adapter of another base model: its q_proj has 128 outputs, not 64
    _peft_adapter(tiny_models["qwen3"], other, target_modules=["q_proj"])
    with pytest.raises(BadRequestError, match=r"q_proj: A .* do not fit this model's 64 -> \d+ projection"):
        read(other)


def test_lora_request_fields():
    assert LoRARequest("a", 1, "/x").lora_int_id == 1
    for args, field in ((("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                        (("a", True, "/x"), "lora_int_id"), (("a", 1, None), "lora_path")):
        with pytest.raises(BadRequestError, match=f"{field}=.* is out of range"):
            LoRARequest(*args)
