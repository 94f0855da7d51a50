"""TensorRT-LLM's ``SamplingConfig`` (the HLAPI's, over the runtime's fields) and its translation into a native
``SamplingParams``.

Semantics are TensorRT-LLM's: decoding is greedy unless top_k > 1 or top_p > 0 (then temperature applies,
default 1.0); beam_width > 1 is beam search (ember's, transformers' rules) returning every beam; end_id ends a
sequence (default: the model's EOS ids); min_length is the least number of new tokens.
"""

from __future__ import annotations

from typing import Any

from ember.sampling_params import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 32
_UNSUPPORTED = {"top_p_decay": "decays top_p per token", "top_p_min": "is top_p_decay's floor",
                "top_p_reset_ids": "resets top_p_decay"}
FIELDS = ("end_id", "pad_id", "max_new_tokens", "beam_width", "beam_search_diversity_rate", "early_stopping",
          "frequency_penalty", "length_penalty", "min_length", "presence_penalty", "random_seed",
          "repetition_penalty", "temperature", "top_k", "top_p", "top_p_decay", "top_p_min", "top_p_reset_ids")


class SamplingConfig:
    """Every field TensorRT-LLM's SamplingConfig has; None means its default. Printed as TensorRT-LLM prints it
    (the fields that are set)."""

    def __init__(self, end_id: int | None = None, pad_id: int | None = None, beam_width: int = 1,
                 max_new_tokens: int | None = None, **fields: Any) -> None:
        self.end_id = end_id
        self.pad_id = pad_id if pad_id is not None else end_id
        self.max_new_tokens = max_new_tokens
        self.beam_width = beam_width
        for name in FIELDS[4:]:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise ValueError(f"SamplingConfig has no field {sorted(fields)[0]!r}: its fields are {', '.join(FIELDS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise AttributeError(f"SamplingConfig has no field {name!r}: its fields are {', '.join(FIELDS)}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return "SamplingConfig(" + ", ".join(f"{k}={getattr(self, k)}" for k in FIELDS
                                             if getattr(self, k) is not None) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingConfig) and all(getattr(self, k) == getattr(other, k) for k in FIELDS)


def _early_stopping(value: Any) -> bool | str:
    """TensorRT-LLM's int: 1 stops once beam_width beams finished, 0 uses the heuristic, others never stop early."""
    if value is None:
        return False
    if value in (True, False, "never"):
        return value
    if isinstance(value, int):
        return True if value == 1 else False if value == 0 else "never"
    raise ValueError(f"early_stopping={value!r} is out of range: use 1 (True), 0 (False) or another int ('never')")


def to_sampling_params(sc: SamplingConfig, max_beam_width: int, default_max_new_tokens: int) -> SamplingParams:
    """The native parameters; ValueError (BadRequestError) names any field out of range or without a meaning."""
    if not isinstance(sc, SamplingConfig):
        raise ValueError(f"sampling_config of type {type(sc).__name__} is not supported: pass a SamplingConfig")
    for name, what in _UNSUPPORTED.items():
        if getattr(sc, name) is not None:
            raise ValueError(f"{name}={getattr(sc, name)!r} is not supported on ember (it {what}): leave it None")
    if sc.beam_search_diversity_rate not in (None, 0, 0.0):
        raise ValueError(f"beam_search_diversity_rate={sc.beam_search_diversity_rate!r} is not supported on ember "
                         "(diverse beam search): leave it None or 0")
    width = sc.beam_width
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= max_beam_width:
        raise ValueError(f"beam_width={width!r} is out of range: it must be an integer in [1, max_beam_width="
                         f"{max_beam_width}] (ModelConfig.max_beam_width)")
    top_k, top_p = sc.top_k or 0, sc.top_p or 0.0
    sampling = top_k > 1 or top_p > 0
    kw: dict[str, Any] = dict(
        max_tokens=sc.max_new_tokens if sc.max_new_tokens is not None else default_max_new_tokens,
        min_tokens=max(0, (sc.min_length or 0)),
        temperature=(1.0 if sc.temperature is None else sc.temperature) if sampling else 0.0,
        top_k=top_k if top_k > 1 else 0, top_p=top_p if top_p > 0 else 1.0, seed=sc.random_seed,
        repetition_penalty=1.0 if sc.repetition_penalty is None else sc.repetition_penalty,
        presence_penalty=sc.presence_penalty or 0.0, frequency_penalty=sc.frequency_penalty or 0.0)
    if sc.end_id is not None:
        kw["eos_token_ids"] = (sc.end_id,)
    if width > 1:
        if sampling:
            raise ValueError(f"top_k={sc.top_k!r} / top_p={sc.top_p!r} with beam_width={width} is not supported: "
                             "ember's beam search is deterministic")
        kw.update(beam_width=width, n=width, temperature=0.0, seed=None,
                  length_penalty=1.0 if sc.length_penalty is None else sc.length_penalty,
                  early_stopping=_early_stopping(sc.early_stopping))
    return SamplingParams(**kw)
