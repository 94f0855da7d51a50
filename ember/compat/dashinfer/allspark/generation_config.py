"""DashInfer's generation config: a dict of DashInfer's keys behind a fluent builder, and its translation to
ember's SamplingParams (the only place the two vocabularies meet).

Semantics, as DashInfer defines them:
- ``max_length`` and ``min_length`` count prompt + output tokens (transformers' convention);
- sampling is always on; ``top_k=1`` (or ``do_sample=False`` or ``temperature=0``) is greedy;
- ``early_stopping=True`` stops at ``eos_token_id``; False generates past it up to max_length;
- ``stop_words_ids`` are token sequences that end generation and stay in the output;
- ``suppress_repetition_in_generation``: True suppresses repetition with ``presence_penalty``, False with
  ``repetition_penalty`` (the other one has no effect, with a warning);
- ``length_penalty`` scores beams; there are none (num_beams=1), so a value other than 1.0 is refused;
- ``logprobs`` + ``top_logprobs``: the chosen token's logprob and the top ones at each step;
- ``response_format``: guided decoding, a dict with "type" json_object (any JSON object, or with "json_schema" one
  that follows it), json_schema, regex, choice or grammar (see ``response_format``).
"""

from __future__ import annotations

import json
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
    "enable_tensors_from_model_inference": False,
    # the tokenizer's vocabulary, which DashInfer's loader puts here for its JSON mode; ember reads the model's own
    "vocab": None,
    "vocab_type": None,
}
# features that land in later issues: a non-default value fails instead of being ignored
NOT_YET = {"enable_tensors_from_model_inference": "tensors_from_model_inference (each step's last hidden states and "
                                                  "input embeddings); GeneratedElements.tensors_from_model_inference "
                                                  "stays empty"}


def _check_key(key: str, value: Any) -> None:
    if key not in DEFAULTS:
        raise ValueError(f"generation config key {key!r} is unknown: allowed keys are {sorted(DEFAULTS)}")
    if key in NOT_YET and value not in (None, "", {}, False):
        raise ValueError(f"{key}={value!r} is not supported yet: ember does not implement {NOT_YET[key]} yet; "
                         f"leave {key} unset")
    if key == "mm_info" and value is not None and type(value).__name__ != "MultiMediaInfo":
        raise ValueError(f"mm_info of type {type(value).__name__} is not supported: pass an allspark.MultiMediaInfo")
    if key == "lora_name" and value is not None and not isinstance(value, str):
        raise ValueError(f"lora_name={value!r} is out of range: it must be the name of a loaded adapter (a string)")
    if key == "top_logprobs" and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10):
        raise ValueError(f"top_logprobs={value!r} is out of range: it must be an integer in [0, 10] (DashInfer's "
                         "limit)")
    if key == "repetition_penalty" and isinstance(value, (int, float)) and not 0 < value <= 2:
        raise ValueError(f"repetition_penalty={value!r} is out of range: it must be in (0, 2] (DashInfer's limit; 1 "
                         "means off)")
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
            # length_penalty is left out: it scores beams, there are none, and a value other than 1.0 is refused
            for key in ("top_k", "top_p", "temperature", "repetition_penalty", "min_length", "no_repeat_ngram_size"):
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


# response_format's "type" -> the key holding its value (json_object's schema is optional)
RESPONSE_FORMATS = {"json_object": "json_schema", "json_schema": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}


def response_format(value: Any) -> StructuredOutputsParams | None:
    """DashInfer's ``response_format`` dict as ember's structured output (None: free text): {"type": "json_object"}
    (any JSON object, or with "json_schema": a schema, text or dict), {"type": "json_schema", "json_schema": schema
    or OpenAI's {"name": ..., "schema": schema}}, {"type": "regex", "regex": pattern}, {"type": "choice", "choice":
    [strings]}, {"type": "grammar", "grammar": Lark or GBNF text}."""
    if value in (None, {}):
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    key = RESPONSE_FORMATS.get(kind) if isinstance(kind, str) else None
    if key is None or not set(value) <= {"type", key}:
        raise ValueError(f"response_format={value!r} is not supported: use a dict with \"type\" one of "
                         f"{sorted(RESPONSE_FORMATS)} and its value under the key of that name (json_object: "
                         "optionally \"json_schema\")")
    given = value.get(key)
    if kind == "json_object" and given in (None, "", {}):
        return StructuredOutputsParams(json_object=True)
    if given is None:
        raise ValueError(f"response_format={value!r} lacks {key!r}: a {kind} format needs it")
    if kind == "json_schema" and isinstance(given, Mapping) and isinstance(given.get("schema"), (Mapping, str)):
        given = given["schema"]  # OpenAI's wrapper: {"name": ..., "schema": ..., "strict": ...}
    if key == "json_schema" and isinstance(given, str):
        try:  # read now, so that a broken schema is a bad field, not a failure after the request started
            given = json.loads(given)
        except ValueError as e:
            raise ValueError(f"response_format json_schema is not valid JSON: {e}") from None
    return StructuredOutputsParams(**{"json" if key == "json_schema" else key: given})


class PromptLengthError(ValueError):
    """A prompt that is empty or leaves no room under the engine's max_length (DashInfer answers both with
    ALLSPARK_EXCEED_LIMIT_ERROR)."""


def to_sampling_params(gen: Mapping[str, Any], prompt_len: int, max_model_len: int) -> SamplingParams:
    """The native SamplingParams of a DashInfer generation config, for a prompt of prompt_len tokens.
    Out-of-range values fail here, naming DashInfer's key, before the request reaches the engine."""
    cfg = {**DEFAULTS, **dict(gen)}
    for key, value in cfg.items():
        _check_key(key, value)
    if prompt_len >= max_model_len:
        raise PromptLengthError(f"the prompt has {prompt_len} tokens: with the engine's max_length "
                                f"({max_model_len}) nothing can be generated; shorten the prompt or raise the runtime "
                                "config's max_length")
    max_length = cfg["max_length"]
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= prompt_len:
        raise ValueError(f"max_length={max_length!r} is out of range: it counts prompt and output tokens, so it must "
                         f"be > the prompt's {prompt_len} tokens")
    max_tokens = min(max_length, max_model_len) - prompt_len
    min_length = cfg["min_length"]
    if not isinstance(min_length, int) or min_length < 0:
        raise ValueError(f"min_length={min_length!r} is out of range: it must be an integer >= 0")
    temperature, top_k = cfg["temperature"], cfg["top_k"]
    # checked by ember's own rules even when greedy decoding makes them moot (NaN must not pass unseen)
    SamplingParams(temperature=temperature, top_k=top_k, top_p=cfg["top_p"])
    temperature = float(temperature)
    greedy = not cfg["do_sample"] or top_k == 1 or temperature == 0
    if cfg["length_penalty"] != 1.0:
        raise ValueError(f"length_penalty={cfg['length_penalty']!r} is not supported: it divides a beam's score by "
                         "its length, and there is no beam search here (num_beams=1, as in DashInfer); leave it 1.0")
    # the guide: True uses presence_penalty to suppress repetition, False uses repetition_penalty; the other one
    # has no effect, and saying so beats ignoring a value that was set
    suppress = bool(cfg["suppress_repetition_in_generation"])
    unused, default = ("repetition_penalty", 1.0) if suppress else ("presence_penalty", 0.0)
    if cfg[unused] != default:
        logger.warning("%s=%s has no effect with suppress_repetition_in_generation=%s: %s", unused, cfg[unused],
                       suppress, "presence_penalty suppresses repetition" if suppress
                       else "repetition_penalty suppresses repetition (set it True to use presence_penalty)")
    eos = cfg["eos_token_id"]
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,) if eos is not None else ()
    return SamplingParams(
        temperature=0.0 if greedy else temperature,
        top_k=0 if greedy else top_k,
        top_p=1.0 if greedy else cfg["top_p"],
        seed=cfg["seed"],
        max_tokens=max_tokens,
        min_tokens=min(max(0, min_length - prompt_len), max_tokens),
        repetition_penalty=1.0 if suppress else cfg["repetition_penalty"],
        presence_penalty=cfg["presence_penalty"] if suppress else 0.0,
        frequency_penalty=cfg["frequency_penalty"],
        no_repeat_ngram_size=cfg["no_repeat_ngram_size"],
        bad_words_ids=cfg["bad_words_ids"],
        stop_token_sequences=cfg["stop_words_ids"],
        eos_token_ids=eos_ids,
        ignore_eos=not cfg["early_stopping"],
        logprobs=int(cfg["top_logprobs"] or 0) if cfg["logprobs"] else None,
        structured_outputs=response_format(cfg["response_format"]),
    )
