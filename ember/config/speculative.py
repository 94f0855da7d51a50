"""``SpeculativeConfig``: how the engine drafts tokens for a sequence to verify in one forward pass (vLLM's
``speculative_config`` names). Checked when the engine config is built; torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from ember.config.checks import check, integer, number, one_of
from ember.config.model import QUANT_METHODS
from ember.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method="ngram"``: prompt lookup. The sequence's last n tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min``) are looked up in its prompt and output; the tokens that followed their latest earlier
    occurrence are the draft, at most ``num_speculative_tokens`` of them. Each request drafts as many as its
    measured acceptance pays for (``core.speculator``); no row drafts in a step with more than
    ``disable_by_batch_size`` decoding rows (None: the engine's measured default).

    ``method="suffix"``: suffix decoding (``core.suffix``): the longest earlier match of the sequence's last
    tokens (up to ``suffix_decoding_max_tree_depth``) in its prompt and output and in the outputs of the last
    ``suffix_decoding_max_cached_requests`` finished requests (0: none); the continuation most of its occurrences
    share, while that share stays >= ``suffix_decoding_min_token_prob``, at most
    ``suffix_decoding_max_spec_factor`` tokens a matched token. ``num_speculative_tokens`` defaults to the depth.

    ``method="draft_model"``: ``model`` (a path, as the engine's ``model``: a smaller model sharing the model's
    tokenizer) drafts greedily where prompt lookup finds nothing (lookup's drafts cost nothing to make);
    ``num_speculative_tokens`` bounds its drafts (``worker.drafter``). Given a ``model``
    and no ``method``, the method is ``draft_model``, as in vLLM. ``quantization`` is the draft's weight layout:
    None (as stored), "none", "int8", "int4" or "w8a8", quantized at load as ``EngineConfig.quantization`` does
    (no calibrated algorithm): a draft's weights decide only speed, and at batch 1 its step costs about the bytes
    it reads."""

    method: str | None = None  # None: "draft_model" when a model is given, else "ngram"
    num_speculative_tokens: int | None = None  # None: suffix_decoding_max_tree_depth for "suffix", else 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    model: str | None = None
    quantization: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        try:
            check(self, _RULES)
        except ConfigError as e:  # named as the user wrote it
            raise ConfigError(f"speculative_config.{e}") from None
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens",
                               self.suffix_decoding_max_tree_depth if self.method == "suffix" else 8)
        if self.suffix_decoding_max_spec_factor * self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError(f"speculative_config.suffix_decoding_max_spec_factor="
                              f"{self.suffix_decoding_max_spec_factor!r} is out of range: with "
                              f"suffix_decoding_max_tree_depth={self.suffix_decoding_max_tree_depth} no match drafts "
                              "a token; factor x depth must be >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} is out of range: it "
                              f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"speculative_config.model={self.model!r} is not a path: pass the draft model's folder "
                              "or .gguf file")
        if self.method == "draft_model" and self.model is None:
            raise ConfigError("speculative_config.model is required by method='draft_model': pass the draft model's "
                              "path (a Hugging Face folder or a .gguf file sharing the model's tokenizer)")
        if self.quantization is not None and self.model is None:
            raise ConfigError(f"speculative_config.quantization={self.quantization!r} is only read with a draft "
                              "model: leave it out, or pass speculative_config.model")
        changed = [f.name for f in fields(self) if f.name.startswith("suffix_") and getattr(self, f.name) != f.default]
        if self.method != "suffix" and changed:
            raise ConfigError(f"speculative_config.{changed[0]}={getattr(self, changed[0])!r} is only read by "
                              f"method='suffix' (the method is {self.method!r}): leave it out, or set method='suffix'")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"speculative_config.model={self.model!r} is only read by method='draft_model' (the "
                              f"method is {self.method!r}): leave it out, or set method='draft_model'")

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig``, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config={value!r} is not supported: pass a dict such as "
                              "{'method': 'ngram', 'num_speculative_tokens': 4}, a SpeculativeConfig or None")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]} is not supported: the keys are "
                              f"{', '.join(sorted(known))}")
        return cls(**value)


_RULES = {
    "method": one_of(SPECULATIVE_METHODS),
    "num_speculative_tokens": integer(1, optional=True),
    "prompt_lookup_max": integer(1),
    "prompt_lookup_min": integer(1),
    "disable_by_batch_size": integer(1, optional=True),
    "quantization": one_of(("none", *QUANT_METHODS), optional=True),
    "suffix_decoding_max_tree_depth": integer(2),
    "suffix_decoding_max_cached_requests": integer(0),
    "suffix_decoding_max_spec_factor": number(0.0, 64.0, low_open=True),
    "suffix_decoding_min_token_prob": number(0.0, 1.0),
}
