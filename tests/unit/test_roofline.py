"""The decode roofline ``ember bench latency`` prints: the bytes a token reads, counted from the model's files
(tied and untied embeddings), and each backend's share of bandwidth / bytes. No model runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ember.benchmarks import roofline


def _gguf(path, tensors: dict[str, np.ndarray]) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


EMBED = np.zeros((64, 16), np.float32)  # 4096 bytes
Q = np.zeros((16, 16), np.float16)  # 512 bytes


def test_a_gguf_counts_its_tensors_less_an_untied_embedding(tmp_path):
    _gguf(tmp_path / "untied.gguf", {"token_embd.weight": EMBED, "blk.0.attn_q.weight": Q,
                                     "output.weight": EMBED})
    _gguf(tmp_path / "tied.gguf", {"token_embd.weight": EMBED, "blk.0.attn_q.weight": Q})
    nbytes, counted = roofline.decode_bytes(str(tmp_path / "untied.gguf"))
    assert nbytes == 4096 + 512 and "less the token embedding" in counted
    nbytes, counted = roofline.decode_bytes(str(tmp_path / "tied.gguf"))
    assert nbytes == 4096 + 512 and "is the LM head" in counted


@pytest.mark.parametrize("tied", [True, False])
def test_a_folder_counts_its_parameters_in_the_run_dtype(tmp_path, tied):
    tensors = {"model.embed_tokens.weight": torch.zeros(64, 16), "model.layers.0.q.weight": torch.zeros(16, 16)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(64, 16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    nbytes, _ = roofline.decode_bytes(str(tmp_path), "bfloat16")
    assert nbytes == 2 * (64 * 16 + 16 * 16)  # untied: the LM head instead of the embedding, the same size here
    nbytes, _ = roofline.decode_bytes(str(tmp_path), "float32")
    assert nbytes == 4 * (64 * 16 + 16 * 16)


def test_a_folder_without_weights_is_named(tmp_path):
    with pytest.raises(ValueError, match="no .safetensors"):
        roofline.decode_bytes(str(tmp_path))


def test_the_bandwidth_is_a_positive_rate():
    assert roofline.stream_bandwidth(1, nbytes=1 << 22, passes=3) > 0


def test_the_line_gives_each_backends_share_of_the_roofline():
    fig = {"prompt_32": {"decode_tokens_per_s": 12.0}, "prompt_512": {"decode_tokens_per_s": 10.0},
           "peak_rss_mib": 1.0}
    record = {"median": {"ember": fig, "llamacpp": {"prompt_32": {"decode_tokens_per_s": 15.0}}},
              "roofline": {"tokens_per_s": 20.0, "bandwidth_gb_s": 20.0, "bytes_per_token": 10 ** 9,
                           "counted": "the GGUF's tensors as stored", "threads": 2, "method": "torch.sum"}}
    line = roofline.share_line(record)
    assert "20.0 tok/s = 20.0 GB/s" in line and "1000 MB a token" in line
    assert "ember 60% (prompt 32), 50% (prompt 512)" in line and "llama.cpp 75% (prompt 32)" in line
    assert roofline.share_line({"median": {}}) is None
