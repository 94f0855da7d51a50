"""The model's tokenizer and chat template, through Hugging Face's fast tokenizers.

A Hugging Face folder brings tokenizer.json / tokenizer_config.json; a GGUF file carries its vocabulary, merges and
chat template in its metadata, which transformers turns into the same fast tokenizer.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ember.cache import cache_dir, file_key

Message = dict[str, Any]


class Tokenizer:
    """Thin wrapper that fixes the few calls the engine needs."""

    __slots__ = ("hf", "eos_token_id", "bos_token_id", "vocab_size")

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)

    @classmethod
    def load(cls, path: str, gguf_file: str | None = None) -> "Tokenizer":
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # GGUF conversion logs every unparsed key
        try:
            if gguf_file is not None:
                hf = _load_gguf_tokenizer(gguf_file)
            else:
                hf = AutoTokenizer.from_pretrained(path)
        finally:
            hf_logging.set_verbosity(verbosity)
        return cls(hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_id(self, token_id: int) -> str:
        return self.hf.convert_ids_to_tokens(token_id)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text with the model's jinja2 chat template."""
        if not self.has_chat_template:
            raise ValueError("messages: this model's tokenizer has no chat template; pass a plain prompt instead")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _cache_dir(gguf_file: str) -> str:
    return cache_dir("tokenizers", file_key(gguf_file))


def _load_gguf_tokenizer(gguf_file: str) -> Any:
    """Converting a GGUF vocabulary to a fast tokenizer takes seconds; keep the result in a cache folder."""
    from transformers import AutoTokenizer

    cached = _cache_dir(gguf_file)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        hf.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return hf
