"""The BERT encoder's checkpoint reading: every tensor it holds must come, by its Hugging Face name (a task
model's ``bert.`` prefix and the old gamma / beta names accepted); its config's unsupported switches named."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig
from transformers import BertModel as HFBertModel

from ember.models.bert import BertModel

CONFIG = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=32)


def _weights(prefix: str = "") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {prefix + k: v for k, v in HFBertModel(BertConfig(**CONFIG)).state_dict().items()}


def test_reads_a_task_models_names_and_refuses_a_missing_tensor():
    model = BertModel("BertModel", BertConfig(**CONFIG), 32, torch.float32)
    weights = _weights("bert.")
    model.load_weights(weights.items())  # the pooler and position_ids are not read
    key = weights["bert.encoder.layer.1.attention.self.key.weight"]
    torch.testing.assert_close(model.layers[1].qkv.weight[16:32], key)  # query, key, value stacked
    del weights["bert.encoder.layer.1.output.LayerNorm.bias"]
    with pytest.raises(ValueError, match=r"^encoder\.layer\.1\.output\.LayerNorm\.bias is not in the checkpoint"):
        BertModel("BertModel", BertConfig(**CONFIG), 32, torch.float32).load_weights(weights.items())


@pytest.mark.parametrize("field, value", [("position_embedding_type", "relative_key"), ("hidden_act", "swish")])
def test_unsupported_config_switches_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field}={value!r} is not supported"):
        BertModel("BertModel", BertConfig(**CONFIG, **{field: value}), 32, torch.float32)
