"""Checkpoints for the embedding tests: a tiny random-initialised ``BertModel`` saved as a sentence-transformers
folder (its own modules: Transformer, Pooling, optionally Normalize), and where the real all-MiniLM-L6-v2 lies."""

from __future__ import annotations

import os

import torch

MINILM_ENV = "EMBER_TEST_MINILM"  # a folder holding all-MiniLM-L6-v2 as sentence-transformers saves it
MINILM_DEFAULT = "/tmp/minilm/all-MiniLM-L6-v2"  # where docs/embeddings.md unpacks the PyPI package
WORDS = ("the quick brown fox jumps over lazy dog a an and or of to in on at is was be it this that with for from "
         "by as are were engine token model vector text sentence search query answer cat sat mat hello world").split()


def minilm_path() -> str | None:
    path = os.environ.get(MINILM_ENV, MINILM_DEFAULT)
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None


def texts(n: int, low: int, high: int, seed: int) -> list[str]:
    """n sentences of low..high words from WORDS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(low, high + 1, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)) + ".")
    return out


def save_st_bert(out: str, pooling: str, normalize: bool, max_seq_length: int = 100, seed: int = 0) -> str:
    """A random BertModel (hidden 64, two layers, four heads) with a WordPiece vocabulary of WORDS and letters,
    saved by sentence-transformers with a ``pooling`` Pooling module and, if asked, a Normalize module."""
    import warnings

    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizer

    raw = os.path.join(out, "raw")
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, ".", ",", "!", "?",
             *(f"##{c}" for c in letters), *WORDS]
    tok = BertTokenizer(vocab={w: i for i, w in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)
    assert tok("the fox")["input_ids"][1] > 4, "the vocabulary was not read: every word would be [UNK]"
    config = BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, hidden_act="gelu", initializer_range=0.2)
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(raw)
    tok.save_pretrained(raw)
    with warnings.catch_warnings():  # the module classes moved in sentence-transformers 6; the old path still works
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models
    modules = [models.Transformer(raw, max_seq_length=max_seq_length), models.Pooling(64, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    folder = os.path.join(out, "st")
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    return folder


def cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).tolist()
