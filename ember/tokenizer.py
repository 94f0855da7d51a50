"""The model's tokenizer and chat template, through Hugging Face's fast tokenizers.

A Hugging Face folder brings tokenizer.json / tokenizer_config.json; a GGUF file carries its vocabulary, merges and
chat template in its metadata, which transformers turns into the same fast tokenizer (converted once, then cached).

Encoding and decoding run on the `tokenizers` library directly when the folder holds a tokenizer of transformers'
generic class (``TokenizersBackend``: what transformers writes for a converted GGUF, an .asmodel and ember's own
caches), whose encode and decode are the library's calls unchanged. Importing transformers costs 0.4-0.8 s on this
machine, most of ``ember generate``'s start-up budget, so transformers' tokenizer (``.hf``) is built only when
something needs it: a chat template, llguidance, save_pretrained. Any other class loads through transformers at once.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any

from ember.cache import cache_dir, file_key, replace_with
from ember.errors import ConfigError

Message = dict[str, Any]
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_FAST_COPY = "ember-fast-tokenizer.json"  # a GGUF folder's pipeline as transformers builds it (_check_fast_copy)
_FAST_CHECK = "ember-fast-tokenizer-check.json"  # {"transformers": version, "same": whether the copy matched}
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json settings with which transformers changes the tokenizer it loads (add_bos_token / add_eos_token
# whenever present): such folders load through it
_CHANGED_ON_LOAD = ("clean_up_tokenization_spaces", "split_special_tokens", "added_tokens_decoder",
                    "extra_special_tokens", "additional_special_tokens")


class Tokenizer:
    """Thin wrapper that fixes the few calls the engine needs."""

    __slots__ = ("_hf", "_fast", "_folder", "_lock", "_template", "_special_tokens", "eos_token_id", "bos_token_id",
                 "vocab_size", "has_chat_template")

    def __init__(self, hf_tokenizer: Any = None, *, fast: Any = None, folder: str | None = None,
                 eos_token_id: int | None = None, bos_token_id: int | None = None,
                 has_chat_template: bool = False, template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        """Either a transformers tokenizer, or a `tokenizers.Tokenizer` with the folder transformers can load the
        same tokenizer from (on first use of ``.hf``); template: its one chat template, rendered by
        ember.chat_template (None: transformers renders), special_tokens: the template's token variables."""
        self._hf, self._fast, self._folder = hf_tokenizer, fast, folder
        self._template, self._special_tokens = template, special_tokens or {}
        self._lock = threading.Lock()
        if hf_tokenizer is not None:
            self.eos_token_id: int | None = hf_tokenizer.eos_token_id
            self.bos_token_id: int | None = hf_tokenizer.bos_token_id
            self.vocab_size: int = len(hf_tokenizer)
            self.has_chat_template: bool = bool(getattr(hf_tokenizer, "chat_template", None))
        else:
            self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id
            self.vocab_size = fast.get_vocab_size(with_added_tokens=True)
            self.has_chat_template = has_chat_template

    @classmethod
    def load(cls, path: str, gguf_file: str | None = None) -> "Tokenizer":
        """ConfigError naming the file when its tokenizer cannot be read (the tokenizers library and transformers'
        GGUF conversion raise their own types, some of them bare ``Exception``)."""
        try:
            if gguf_file is None:
                return cls._from_folder(path) or cls(_auto_tokenizer(path))
            path = _gguf_tokenizer_folder(gguf_file)
            tok = cls._from_folder(path) or cls._from_checked_copy(path)
            if tok is None:
                hf = _auto_tokenizer(path)
                _check_fast_copy(path, hf)
                tok = cls(hf)
            return tok
        except (ConfigError, ImportError):
            raise
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"tokenizer of {gguf_file or path!r} cannot be read: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_folder(cls, folder: str) -> "Tokenizer | None":
        """The fast path for a folder of transformers' generic class whose encode and decode are the library's
        unchanged (tests/unit/frontend/test_chat_template.py compares them); None when the folder needs transformers."""
        try:
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        changed = any(k in config for k in ("add_bos_token", "add_eos_token")) or any(
            config.get(k) for k in _CHANGED_ON_LOAD)
        if (changed or config.get("tokenizer_class") not in _GENERIC_CLASSES
                or not os.path.isfile(os.path.join(folder, "tokenizer.json"))):
            return None
        from tokenizers import Tokenizer as FastTokenizer

        fast = FastTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        if (fast.post_processor is None or fast.padding is not None or fast.truncation is not None
                or any(fast.token_to_id(t) is None for t in _special_tokens(config).values())):
            return None  # transformers would rebuild the post-processor, add the tokens, or pad / truncate otherwise
        return cls._with_config(fast, folder, config)

    @classmethod
    def _from_checked_copy(cls, folder: str) -> "Tokenizer | None":
        """A GGUF tokenizer of a model-specific class (Qwen2Tokenizer, GemmaTokenizer: transformers builds their
        pipeline in ``__init__``, 1-6 s with its import) from the copy of the pipeline transformers built, saved once
        it gave transformers' ids and text on every probe (``_check_fast_copy``) with this transformers version."""
        try:
            with open(os.path.join(folder, _FAST_CHECK), encoding="utf-8") as f:
                check = json.load(f)
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        copy = os.path.join(folder, _FAST_COPY)
        if not (isinstance(check, dict) and check.get("same") is True
                and check.get("transformers") == _transformers_version() and os.path.isfile(copy)):
            return None
        from tokenizers import Tokenizer as FastTokenizer

        return cls._with_config(FastTokenizer.from_file(copy), folder, config)

    @classmethod
    def _with_config(cls, fast: Any, folder: str, config: dict[str, Any]) -> "Tokenizer":
        special = _special_tokens(config)
        template, named = config.get("chat_template"), os.path.isdir(os.path.join(folder, "additional_chat_templates"))
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        plain = template if isinstance(template, str) and not named else None  # named templates: transformers
        return cls(fast=fast, folder=folder, eos_token_id=_token_id(fast, special.get("eos_token")),
                   bos_token_id=_token_id(fast, special.get("bos_token")), has_chat_template=bool(template),
                   template=plain, special_tokens=special)

    @property
    def hf(self) -> Any:
        """transformers' tokenizer for the same files (built on first use)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    self._hf = _auto_tokenizer(self._folder)
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_id(self, token_id: int) -> str:
        if self._fast is not None:
            return self._fast.id_to_token(token_id)
        return self._hf.convert_ids_to_tokens(token_id)

    @property
    def chat_template(self) -> str:
        """The chat template's text ("" without one): the server reads which tool-call and reasoning format the
        model was taught from it."""
        if self._template is not None:
            return self._template
        if not self.has_chat_template:
            return ""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else "\n".join((template or {}).values())

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text with the model's jinja2 chat template: by ember.chat_template
        (transformers' environment) where it covers the call, else by transformers itself."""
        if not self.has_chat_template:
            raise ValueError("messages: this model's tokenizer has no chat template; pass a plain prompt instead")
        if self._template is not None:
            from ember import chat_template

            try:
                return chat_template.render(self._template, messages, self._special_tokens, add_generation_prompt,
                                            **kwargs)
            except chat_template.Unsupported:
                pass
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    special = {}
    for name in _SPECIAL_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            special[name] = str(token)
    return special


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # the installed version, without importing it

    try:
        return version("transformers")
    except PackageNotFoundError:
        return ""


# what the copy must encode and decode as transformers does: normalisation (a combining accent), whitespace runs,
# line ends, digits, scripts, emoji, code; every special token of the vocabulary is added to them
_PROBES = ("Hello world", "  leading spaces,  double  spaces  ", "e\u0301 caf\u00e9 na\u00efve \uff21\u2460",
           "\u6570\u5b57 123456 \u4e2d\u6587 \u65e5\u672c\u8a9e", "emoji \U0001f917\U0001f389", "\r\n\r\nwindows\ttab",
           "def f(x):\n\treturn x**2  # comment\n\n\n", "")


def _check_fast_copy(folder: str, hf: Any) -> None:
    """Save the pipeline transformers built for a GGUF folder of a model-specific class (``_from_checked_copy``)
    and whether it gave transformers' ids and text on every probe; once per transformers version. A cache that
    cannot be written keeps the slow path."""
    if type(hf).__name__ in _GENERIC_CLASSES or not hasattr(hf, "backend_tokenizer"):
        return
    try:
        with open(os.path.join(folder, _FAST_CHECK), encoding="utf-8") as f:
            if json.load(f) == {"transformers": _transformers_version(), "same": False}:
                return  # found different with this version already
    except (OSError, ValueError):
        pass
    fast = hf.backend_tokenizer
    specials = "".join(str(t) for t in getattr(hf, "all_special_tokens", ()))
    config = {name: getattr(hf, name, None) for name in _SPECIAL_TOKENS}
    same = len(hf) == fast.get_vocab_size(with_added_tokens=True) and all(
        hf.convert_tokens_to_ids(str(token)) == fast.token_to_id(str(token)) for token in config.values() if token)
    for text in (*_PROBES, specials + "x" + specials, f"{specials} hi {_PROBES[2]}"):
        for add in (True, False):
            ids = list(hf.encode(text, add_special_tokens=add))
            same = same and ids == fast.encode(text, add_special_tokens=add).ids and all(
                hf.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
                for skip in (True, False))
    def check(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"transformers": _transformers_version(), "same": same}, f)

    try:
        if same:
            replace_with(os.path.join(folder, _FAST_COPY), fast.save)
        replace_with(os.path.join(folder, _FAST_CHECK), check)
    except OSError:
        pass


def _token_id(fast: Any, token: str | None) -> int | None:
    return fast.token_to_id(token) if token is not None else None


def _auto_tokenizer(path: str, **kwargs: Any) -> Any:
    """transformers' tokenizer, its warnings muted (a GGUF conversion logs every unparsed key)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kwargs)  # an auto_map is never run
    finally:
        hf_logging.set_verbosity(verbosity)


def _cache_dir(gguf_file: str) -> str:
    return cache_dir("tokenizers", file_key(gguf_file))


def _gguf_tokenizer_folder(gguf_file: str) -> str:
    """A folder holding the GGUF file's tokenizer as transformers converts it. The conversion takes seconds, so it is
    done once into ember's cache; a cache that cannot be written gets a temporary folder (converted again next time)."""
    cached = _cache_dir(gguf_file)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return cached
    hf = _auto_tokenizer(os.path.dirname(gguf_file), gguf_file=os.path.basename(gguf_file))
    if (getattr(hf, "clean_up_tokenization_spaces", False) and type(hf.backend_tokenizer.model).__name__ == "BPE"
            and getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None) is False):
        # transformers 5 converts GPT-2-style GGUF vocabularies with this set and then ignores it for BPE: saved as
        # False, the folder decodes the same and takes the fast path (``Tokenizer._from_folder``)
        hf.clean_up_tokenization_spaces = False
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
    except OSError:
        tmp = tempfile.mkdtemp(prefix="ember-tokenizer-")
    hf.save_pretrained(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # a read-only cache, or another process stored it first
        return cached if os.path.isfile(os.path.join(cached, "tokenizer.json")) else tmp
    return cached
