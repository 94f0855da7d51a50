"""DashInfer's generation config: a dict of DashInfer's keys behind a fluent builder, and its translation to
ember's SamplingParams (the only place the two vocabularies meet).

Semantics, as DashInfer defines them:
- ``max_length`` and ``min_length`` count prompt + output tokens (transformers' convention);
- sampling is always on; ``top_k=1`` (or ``do_sample=False`` or ``temperature=0``) is greedy;
- ``early_stopping=True`` stops at ``eos_token_id``; False generates past it up to max_length;
- ``stop_words_ids`` are token sequences that end generation and stay in the output;
- ``suppress_repetition_in_generation`` applies repetition_penalty to generated tokens only;
- ``logprobs`` + ``top_logprobs``: the chosen token's logprob and the top ones at each step;
- ``response_format``: ``{"type": "json_object"}`` for any JSON object, with ``"json_schema": schema`` (the schema
  as JSON text or a dict) for one that follows the schema (DashInfer's guided decoding: JSON only).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any

from ember.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("ember")

_RAND_MAX = 0x7FFFFFFF

# key -> default; every key DashInfer's reference lists, plus the ones its engine also reads
DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "max_length": 2048,
    "min_length": 0,
    "early_stopping": True,
    "stop_words_ids": None,
    "bad_words_ids": None,
    "eos_token_id": None,
    "no_repeat_ngram_size": 0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "suppress_repetition_in_generation": False,
    "seed": None,
    "logprobs": False,
    "top_logprobs": 0,
    "lora_name": None,
    "mm_info": None,
    "response_format": None,
    "num_beams": 1,
    "num_return_sequences": 1,
    "uuid": None,
}
# features that land in later issues: a non-default value fails instead of being ignored
NOT_YET = {"mm_info": "multimedia inputs"}


def _check_key(key: str, value: Any) -> None:
    if key not in DEFAULTS:
        raise ValueError(f"generation config key {key!r} is unknown: allowed keys are {sorted(DEFAULTS)}")
    if key in NOT_YET and value not in (None, "", {}):
        raise ValueError(f"{key}={value!r} is not supported yet: ember does not implement {NOT_YET[key]} yet; "
                         f"leave {key} unset")
    if key == "lora_name" and value is not None and not isinstance(value, str):
        raise ValueError(f"lora_name={value!r} is out of range: it must be the name of a loaded adapter (a string)")
    if key in ("num_beams", "num_return_sequences") and value != 1:
        raise ValueError(f"{key}={value!r} is not supported: beam search and several returned sequences are not "
                         f"implemented (DashInfer does not implement them either); use {key}=1")


class ASGenerationConfigBuilder(Mapping):
    """A generation config: read it like a dict, change it with update({...}), [key] = value or the fluent
    setters (builder.temperature(0.7).top_k(50)); build() returns a plain dict copy. Unknown keys fail at once."""

    def __init__(self, hf_gen_config: Any = None, seed: int | None = None, eos_token_id: int | None = None) -> None:
        self.dict_store: dict[str, Any] = {"do_sample": True, "early_stopping": True,
                                           "seed": seed if seed is not None else random.randint(1, _RAND_MAX)}
        if eos_token_id is not None:
            self.dict_store["eos_token_id"] = eos_token_id
        if hf_gen_config is not None:
            gen = hf_gen_config if isinstance(hf_gen_config, dict) else hf_gen_config.to_dict()
            for key in ("top_k", "top_p", "temperature", "repetition_penalty", "length_penalty", "min_length",
                        "no_repeat_ngram_size"):
                if gen.get(key) is not None:
                    self.dict_store[key] = gen[key]
            if gen.get("max_length") is not None:
                self.dict_store["max_length"] = gen["max_length"]
            self.process_eos_tokens(gen.get("eos_token_id"), self.dict_store)
            if gen.get("num_return_sequences", 1) not in (None, 1):
                raise ValueError("Generation Config: num_return_sequences != 1 is not supported")

    @staticmethod
    def process_eos_tokens(eos: int | list[int] | None, out: dict[str, Any]) -> None:
        """An int is the EOS; a list makes its first the EOS and every one a one-token stop word (as DashInfer)."""
        if isinstance(eos, int):
            out["eos_token_id"] = eos
        elif isinstance(eos, list) and eos and all(isinstance(t, int) for t in eos):
            out["eos_token_id"] = eos[0]
            out["stop_words_ids"] = [[t] for t in eos]

    # ----- dict-like -----

    def __getitem__(self, key: str) -> Any:
        if key in self.dict_store:
            return self.dict_store[key]
        if key in DEFAULTS:
            return DEFAULTS[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(DEFAULTS)

    def __len__(self) -> int:
        return len(DEFAULTS)

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def update(self, update_fields: dict[str, Any]) -> "ASGenerationConfigBuilder":
        """Set several keys at once; a key DashInfer does not define fails with the list of allowed ones."""
        if not isinstance(update_fields, dict):
            raise ValueError(f"update() takes a dict of generation config keys, not {type(update_fields).__name__}")
        for key, value in update_fields.items():
            _check_key(key, value)
        self.dict_store.update(update_fields)
        return self

    def build(self) -> dict[str, Any]:
        return {**DEFAULTS, **self.dict_store}

    def __repr__(self) -> str:
        return f"ASGenerationConfigBuilder({self.dict_store})"

    # ----- fluent setters (DashInfer's names) -----

    def do_sample(self, flag: bool = True) -> "ASGenerationConfigBuilder":
        return self.update({"do_sample": flag})

    def early_stopping(self, flag: bool = True) -> "ASGenerationConfigBuilder":
        return self.update({"early_stopping": flag})

    def log_probs(self, enable_logprobs: bool, top_logprobs: int) -> "ASGenerationConfigBuilder":
        return self.update({"logprobs": enable_logprobs, "top_logprobs": top_logprobs})

    def with_mm_info(self, info: Any) -> "ASGenerationConfigBuilder":
        return self.update({"mm_info": info})


def _setter(key: str):
    def set_value(self: ASGenerationConfigBuilder, value: Any) -> ASGenerationConfigBuilder:
        return self.update({key: value})

    set_value.__name__ = key
    set_value.__doc__ = f"Set {key!r}; returns the builder."
    return set_value


for _key in DEFAULTS:
    if not hasattr(ASGenerationConfigBuilder, _key):
        setattr(ASGenerationConfigBuilder, _key, _setter(_key))


def response_format(value: Any) -> StructuredOutputsParams | None:
    """DashInfer's ``response_format`` as ember's structured output (None: free text)."""
    if value in (None, {}):
        return None
    if not isinstance(value, Mapping) or value.get("type") != "json_object" \
            or not set(value) <= {"type", "json_schema"}:
        raise ValueError(f"response_format={value!r} is not supported: DashInfer's guided decoding takes "
                         '{"type": "json_object"}, optionally with "json_schema": a JSON schema (text or dict)')
    schema = value.get("json_schema")
    return StructuredOutputsParams(json_object=True) if schema in (None, "", {}) \
        else StructuredOutputsParams(json=schema)


def to_sampling_params(gen: Mapping[str, Any], prompt_len: int, max_model_len: int) -> SamplingParams:
    """The native SamplingParams of a DashInfer generation config, for a prompt of prompt_len tokens.
    Out-of-range values fail here, naming DashInfer's key, before the request reaches the engine."""
    cfg = {**DEFAULTS, **dict(gen)}
    for key, value in cfg.items():
        _check_key(key, value)
    max_length = cfg["max_length"]
    if not isinstance(max_length, int) or max_length <= prompt_len:
        raise ValueError(f"max_length={max_length!r} is out of range: it counts prompt and output tokens, so it must "
                         f"be > the prompt's {prompt_len} tokens")
    max_length = min(max_length, max_model_len)
    max_tokens = max_length - prompt_len
    if max_tokens < 1:
        raise ValueError(f"the prompt has {prompt_len} tokens: with the engine's max_length ({max_model_len}) "
                         "nothing can be generated; shorten the prompt or raise the runtime config's max_length")
    min_length = cfg["min_length"]
    if not isinstance(min_length, int) or min_length < 0:
        raise ValueError(f"min_length={min_length!r} is out of range: it must be an integer >= 0")
    temperature = float(cfg["temperature"])
    top_k = cfg["top_k"]
    greedy = not cfg["do_sample"] or top_k == 1 or temperature == 0
    if cfg["length_penalty"] != 1.0:
        logger.warning("length_penalty=%s has no effect: it only scores beams, and there is no beam search "
                       "(transformers ignores it in sampling too)", cfg["length_penalty"])
    eos = cfg["eos_token_id"]
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ()
    return SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_k=0 if greedy else top_k,
        top_p=1.0 if greedy else cfg["top_p"],
        seed=cfg["seed"],
        max_tokens=max_tokens,
        min_tokens=min(max(0, min_length - prompt_len), max_tokens),
        repetition_penalty=cfg["repetition_penalty"],
        repetition_penalty_output_only=bool(cfg["suppress_repetition_in_generation"]),
        presence_penalty=cfg["presence_penalty"],
        frequency_penalty=cfg["frequency_penalty"],
        no_repeat_ngram_size=cfg["no_repeat_ngram_size"],
        bad_words_ids=cfg["bad_words_ids"],
        stop_token_sequences=cfg["stop_words_ids"],
        eos_token_ids=eos_ids,
        ignore_eos=not cfg["early_stopping"],
        logprobs=int(cfg["top_logprobs"] or 0) if cfg["logprobs"] else None,
        structured_outputs=response_format(cfg["response_format"]),
    )
