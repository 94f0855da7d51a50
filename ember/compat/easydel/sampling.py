"""EasyDeL's ``SamplingParams`` (easydel/inference/sampling_params.py): its fields and defaults, checked at
construction by building ember's own SamplingParams from them, so a bad value fails where it is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ember.sampling_params import OutputKind
from ember.sampling_params import SamplingParams as NativeParams
from ember.sampling_params import StructuredOutputsParams


class RequestOutputKind(Enum):
    """EasyDeL's output kinds; vSurge yields cumulative snapshots whichever is set (see vSurge.generate)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class GuidedDecodingParams:
    """EasyDeL's guided decoding (vLLM's fields): exactly one of json (a schema, dict or text), regex, choice,
    grammar (Lark or GBNF) or json_object; backend, backend_was_auto and disable_fallback pick an engine ember does
    not need (it has one, llguidance) and are accepted; structural_tag is refused (ember has no tool-call tags yet).
    EasyDeL stores these without enforcing them; ember enforces them token by token."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self.native()

    def native(self) -> StructuredOutputsParams:
        if self.structural_tag is not None:
            raise ValueError(f"guided_decoding.structural_tag={self.structural_tag!r} is not supported: ember "
                             "constrains to json, regex, choice or grammar; leave structural_tag None")
        return StructuredOutputsParams(
            json=self.json, regex=self.regex, choice=self.choice, grammar=self.grammar, json_object=self.json_object,
            whitespace_pattern=self.whitespace_pattern, disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties)


def guided(value: Any) -> StructuredOutputsParams | None:
    """guided_decoding as ember's StructuredOutputsParams: EasyDeL's GuidedDecodingParams (this module's, or any
    object with its fields), a dict of its fields, or ember's own StructuredOutputsParams."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(GuidedDecodingParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"guided_decoding has keys {sorted(unknown)} that GuidedDecodingParams does not define: "
                             f"use {sorted(GuidedDecodingParams.__dataclass_fields__)}")
        return GuidedDecodingParams(**value).native()
    if isinstance(value, GuidedDecodingParams):
        return value.native()
    names = GuidedDecodingParams.__dataclass_fields__
    fields = {} if isinstance(value, type) else {k: getattr(value, k) for k in names if hasattr(value, k)}
    if not fields:
        raise ValueError(f"guided_decoding of type {type(value).__name__} is not supported: pass GuidedDecodingParams "
                         "(json, regex, choice, grammar or json_object), or a dict of its fields")
    return GuidedDecodingParams(**fields).native()


# fields ember has no counterpart for: refused unless left at their default (None)
_NOT_ON_EMBER = {
    "logit_bias": "ember has no logit bias",
    "allowed_token_ids": "ember has no allowed-token list",
    "logprobs": "EasyDeL's ReturnSample carries no logprobs: use ember.LLM for them",
    "prompt_logprobs": "EasyDeL's ReturnSample carries no logprobs: use ember.LLM for them",
}


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    bad_words: list[str] | None = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    guided_decoding: Any = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, why in _NOT_ON_EMBER.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported: {why}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of!r} is not supported: ember returns the n samples it draws; "
                             "leave best_of None (or equal to n)")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"truncate_prompt_tokens={t!r} is out of range: it must be an integer >= 1 or None")
        if not isinstance(self.bad_words or [], list) or any(not isinstance(w, str) or not w
                                                             for w in self.bad_words or []):
            raise ValueError(f"bad_words={self.bad_words!r} is out of range: it must be a list of non-empty strings")
        self.guided_decoding = guided(self.guided_decoding)  # checked here; EasyDeL's own class accepted too
        if not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args={self.extra_args!r} is out of range: it must be a dict")
        self.native()  # every shared field checked by ember's own rules

    def native(self, bad_words_ids: list[list[int]] | None = None, eos_token_ids: tuple[int, ...] = ()) -> NativeParams:
        """ember's SamplingParams: deltas out of the engine (vSurge accumulates them), EasyDeL's top_k=0 = off;
        eos_token_ids: every id that ends generation (the model's and vSurge's extra ones; empty: the model's)."""
        return NativeParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, bad_words_ids=bad_words_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, output_kind=OutputKind.DELTA, eos_token_ids=eos_token_ids,
            structured_outputs=self.guided_decoding)
