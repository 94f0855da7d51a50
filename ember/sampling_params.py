"""Per-request sampling parameters, in the shape vLLM users already know.

Every field is checked in ``__post_init__`` so a bad request fails in the caller's thread, before it reaches the
engine, with a ValueError that names the field, the value and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from ember.errors import BadRequestError

MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = 64
INT64_MAX = 2**63 - 1  # integers reach int64 tensors and generators: larger ones are refused here, not mid-step
_GREEDY_EPS = 1e-5


class OutputKind(str, Enum):
    """What each item of a request's output stream holds."""

    CUMULATIVE = "cumulative"  # everything so far (vLLM's AsyncLLM default)
    DELTA = "delta"  # only what is new since the last item
    FINAL_ONLY = "final_only"  # one item, when the request ends


def _bad(name: str, value: Any, allowed: str) -> BadRequestError:
    return BadRequestError(f"{name}={value!r} is out of range: {name} must be {allowed}")


def _int_in(value: Any, low: int, high: int = INT64_MAX) -> bool:
    """An int in [low, high]. Bools pass (isinstance): the fields that refuse them check that first."""
    return isinstance(value, int) and low <= value <= high


def _token_id(t: Any) -> bool:
    return not isinstance(t, bool) and _int_in(t, 0)


_GUIDES = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a request's output, token by token (vLLM's ``StructuredOutputsParams``; exactly one kind):

    - json: a JSON schema (a dict or its JSON text); json_object=True: any JSON object;
    - regex: the whole output fullmatches it; choice: the output is exactly one of these strings;
    - grammar: a Lark grammar (llguidance's dialect) or a GBNF / EBNF one (llama.cpp's, recognised by ``::=``).

    JSON layout: by default a run of at most 20 whitespace characters between tokens (unbounded whitespace lets a
    small model loop on newlines); whitespace_pattern: your own regex for it (r"[ \\t\\n\\r]*": any, as JSON allows);
    disable_any_whitespace: compact JSON, no whitespace at all.
    disable_additional_properties: objects get only the properties their schema names."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice) if isinstance(self.choice, (list, tuple))
                               else self.choice)
        given = [k for k in _GUIDES if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise BadRequestError(f"structured_outputs sets {given or 'nothing'}: set exactly one of "
                                  f"{', '.join(_GUIDES)}")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (str, dict)), "regex": isinstance(value, str) and bool(value),
              "grammar": isinstance(value, str) and bool(value.strip()), "json_object": value is True,
              "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)}
        allowed = {"json": "a JSON schema (a dict or JSON text)", "regex": "a non-empty regular expression",
                   "grammar": "a non-empty Lark or GBNF grammar", "json_object": "True",
                   "choice": "a non-empty list of non-empty strings"}
        if not ok[kind]:
            raise _bad(f"structured_outputs.{kind}", value, allowed[kind])
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"structured_outputs.{name}", getattr(self, name), "True or False")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise _bad("structured_outputs.whitespace_pattern", self.whitespace_pattern, "None or a regex string")

    @property
    def kind(self) -> str:
        return next(k for k in _GUIDES if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's name for it before 0.10.2


_FLOATS = {"temperature": ">= 0 (0 means greedy)", "top_p": "in (0, 1]", "min_p": "in [0, 1]",
           "repetition_penalty": "> 0 (1 means off)", "presence_penalty": "in [-2, 2]",
           "frequency_penalty": "in [-2, 2]"}


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; temperature=0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # transformers semantics, over prompt and output
    presence_penalty: float = 0.0  # OpenAI semantics, over output only
    frequency_penalty: float = 0.0
    repetition_penalty_output_only: bool = False  # penalize generated tokens only, not the prompt's
    no_repeat_ngram_size: int = 0  # transformers semantics over prompt + output: no n-gram occurs twice
    bad_words_ids: list[list[int]] | None = None  # token sequences never generated (transformers semantics)
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # token sequences that end generation once the output ends with one (DashInfer's stop_words_ids); the
    # sequence stays in the output, as a stop token id does
    stop_token_sequences: list[list[int]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # chosen token's logprob plus this many top ones
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # beam search (transformers semantics, docs/beam_search.md): beam_width > 1 keeps that many beams and returns
    # the n best finished ones (n <= beam_width), in one final output; scores are summed logprobs divided by
    # (generated length ** length_penalty); early_stopping True | False | "never" as transformers defines it
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # every token id that ends generation; empty: the engine fills in the model's EOS ids (tokenizer and
    # generation config)
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # at most this many tokens inside a thinking block (<think> ... </think>, opened by the prompt or the output):
    # then its end tag is forced and the answer follows (vLLM's thinking_token_budget); None: no limit
    thinking_token_budget: int | None = None
    # the token ids of the model's thinking tags, (start, end); empty: the engine fills in <think> / </think>
    thinking_tags: tuple[tuple[int, ...], tuple[int, ...]] = field(default=(), repr=False)
    # the output follows a JSON schema, regex, choice or grammar (``StructuredOutputsParams``; a dict of its fields
    # is taken too); compiled by the front end, enforced by masking the logits each step
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_sequences = [list(s) for s in self.stop_token_sequences or []]
        self.bad_words_ids = [list(s) for s in self.bad_words_ids or []]
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.thinking_tags = tuple(tuple(tag) for tag in self.thinking_tags)
        self.output_kind = OutputKind(self.output_kind)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise BadRequestError(f"structured_outputs: {e}; the fields are those of StructuredOutputsParams")
        self._validate()

    def _validate(self) -> None:
        for name, allowed in _FLOATS.items():  # None, strings, NaN and infinities are refused before any range
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _bad(name, value, f"a finite number {allowed}")
        for name in ("n", "top_k", "min_tokens", "no_repeat_ngram_size"):
            value = getattr(self, name)
            if isinstance(value, bool):
                raise _bad(name, value, "an integer")
        if not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise _bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not _int_in(self.top_k, 0):
            raise _bad("top_k", self.top_k, f"-1 or an integer in [0, {INT64_MAX}] (-1 and 0 turn it off)")
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not _int_in(self.seed, -INT64_MAX - 1):
            raise _bad("seed", self.seed, f"None or an integer in [{-INT64_MAX - 1}, {INT64_MAX}]")
        if self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "> 0 (1 means off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise _bad(name, value, "in [-2, 2]")
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1):
            raise _bad("max_tokens", self.max_tokens, f"None or an integer in [1, {INT64_MAX}]")
        if not _int_in(self.min_tokens, 0):
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, {INT64_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _int_in(value, 0, MAX_LOGPROBS):
                raise _bad(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(_token_id(t) for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, f"a list of token ids in [0, {INT64_MAX}]")
        if not all(_token_id(t) for t in self.eos_token_ids):
            raise _bad("eos_token_ids", self.eos_token_ids, f"token ids in [0, {INT64_MAX}]")
        for name in ("stop_token_sequences", "bad_words_ids"):
            value = getattr(self, name)
            if any(not s or not all(_token_id(t) for t in s) for s in value):
                raise _bad(name, value, f"a list of non-empty lists of token ids in [0, {INT64_MAX}]")
        if self.thinking_token_budget is not None and not _int_in(self.thinking_token_budget, 0):
            raise _bad("thinking_token_budget", self.thinking_token_budget,
                       f"None or an integer in [0, {INT64_MAX}] (0: the thinking ends at once)")
        if self.thinking_tags and (len(self.thinking_tags) != 2 or not all(
                tag and all(_token_id(t) for t in tag) for tag in self.thinking_tags)):
            raise _bad("thinking_tags", self.thinking_tags, "() or two non-empty lists of token ids (start, end)")
        if not _int_in(self.no_repeat_ngram_size, 0):
            raise _bad("no_repeat_ngram_size", self.no_repeat_ngram_size,
                       f"an integer in [0, {INT64_MAX}] (0 means off)")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise _bad("structured_outputs", so, "None, a StructuredOutputsParams or a dict of its fields")
        self._validate_beams()

    def _validate_beams(self) -> None:
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise _bad("beam_width", w, f"an integer in [1, {MAX_BEAM_WIDTH}] (1 means no beam search)")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise _bad("length_penalty", lp, "a finite number (1.0: scores divided by the length)")
        if self.early_stopping not in (True, False, "never"):
            raise _bad("early_stopping", self.early_stopping, "True, False or 'never'")
        if w == 1:
            return
        if self.n > w:
            raise _bad("n", self.n, f"<= beam_width ({w}): beam search returns at most beam_width beams")
        # beam search ranks whole continuations; these knobs draw or report per token and have no beam meaning
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("logprobs", None), ("seed", None)):
            if getattr(self, name) != off:
                raise _bad(name, getattr(self, name), f"{off!r} with beam_width > 1 (beam search is deterministic "
                                                      "and reports each beam's cumulative logprob)")
        if self.stop:
            raise _bad("stop", self.stop, "empty with beam_width > 1: end beams with stop_token_ids or "
                                          "stop_token_sequences")
        if self.structured_outputs is not None:
            raise _bad("structured_outputs", self.structured_outputs, "None with beam_width > 1 (beams are ranked "
                                                                      "over the whole vocabulary)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def beam_candidates(self) -> int:
        """Continuations each beam offers per step: transformers keeps max(2, 1 + #EOS) x beam_width, so that
        beam_width survive even when the best ones end."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def bans_tokens(self) -> bool:
        """Some tokens may be forbidden at a step (no_repeat_ngram_size, bad_words_ids)."""
        return self.no_repeat_ngram_size > 0 or bool(self.bad_words_ids)

    def clone(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any]) -> "SamplingParams":
        """Defaults from a model's generation_config.json, as vLLM reads it."""
        keys = {f.name for f in fields(cls)}
        kwargs = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen}
        if gen.get("max_new_tokens"):
            kwargs["max_tokens"] = gen["max_new_tokens"]
        return cls(**{k: v for k, v in kwargs.items() if k in keys and v is not None})
