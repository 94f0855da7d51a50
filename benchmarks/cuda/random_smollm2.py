"""A random-initialised Llama with SmolLM2-135M's exact shapes (30 layers, 576 hidden, 9 heads / 3 KV heads, 1536
MLP, 49,152 vocabulary, tied embeddings), in bf16, with the tokenizer of a GGUF beside it. Speed does not depend on
the weights' values, so it stands in for the default model where the 94 MB file cannot travel (a GPU machine).

    python benchmarks/cuda/random_smollm2.py OUT_DIR --tokenizer-gguf FILE.gguf
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer-gguf", required=True)
    a = ap.parse_args()
    tok = Tokenizer.load(a.tokenizer_gguf, gguf_file=a.tokenizer_gguf).hf
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(a.out)
    tok.save_pretrained(a.out)


if __name__ == "__main__":
    main()
