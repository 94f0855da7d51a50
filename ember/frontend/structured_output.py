"""Structured output, the front end's half: a request's ``StructuredOutputsParams`` become an llguidance grammar,
compiled against the model's vocabulary in the caller's thread, so a schema, regex or grammar that cannot compile is
refused with llguidance's own message before anything is queued.

The engine core takes its per-sample matchers from the same ``Grammars`` (``matcher``): a copy of the compiled
grammar, so a schema sent with every request is compiled once. The request record itself carries only the grammar
text (plain and picklable); the core never sees the tokenizer, only matchers.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from ember.errors import BadRequestError
from ember.sampling_params import StructuredOutputsParams
from ember.tokenizer import Tokenizer

# Whitespace JSON may hold between tokens, by default: a run of at most 20 characters (room for a newline and a
# nested indent). Measured on the default model with 50 drawn schemas: unbounded whitespace ("any", as vLLM allows by
# default) left 7 of 25 replies looping on newlines until max_tokens, where the model wanted a token the schema
# forbids; compact JSON left none.
JSON_WHITESPACE = r"[ \t\n\r]{0,20}"
_CACHED = 64  # compiled grammars kept (least recently used dropped); building one costs ~1 ms, a copy ~5 us


def no_additional_properties(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a request's constraint; raises BadRequestError for text that is not a schema."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise BadRequestError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequestError(f"structured_outputs.json={schema!r} is not a JSON schema: a schema is an object")
        if spec.disable_additional_properties:
            schema = no_additional_properties(schema)
        if spec.disable_any_whitespace:
            layout = {"whitespace_flexible": False}
        else:
            layout = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern or JSON_WHITESPACE}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=layout)
        except ValueError as e:  # values llguidance cannot serialize, e.g. integers beyond 64 bits
            raise BadRequestError(f"structured_outputs.json cannot be used as a schema: {e}") from None
    try:
        return llguidance.grammar_from(kind, getattr(spec, kind))
    except ValueError as e:  # a GBNF grammar the converter cannot read
        raise BadRequestError(f"structured_outputs.grammar cannot be read: {e}") from None


class Grammars:
    """Compiles grammars for one model's vocabulary; thread-safe (callers compile, the core takes matchers)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer, self._eos = tokenizer, list(eos_token_ids)
        # the tokenizer's vocabulary: the masks' width (a model's logits may be wider: the worker bans the rest)
        self.vocab_size = tokenizer.vocab_size
        self._lock = threading.Lock()
        self._table: Any = None  # llguidance's view of the vocabulary: built on the first guided request (~0.4 s)
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The grammar text of spec, compiled now; BadRequestError with llguidance's message if it cannot be."""
        grammar = grammar_text(spec)
        self._prototype(grammar, f"structured_outputs.{spec.kind}")
        return grammar

    def matcher(self, grammar: str) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of grammar (one per sample: it is advanced token by token)."""
        return self._prototype(grammar, "grammar").deep_copy()

    def _prototype(self, grammar: str, field: str) -> Any:
        import llguidance

        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
            if self._table is None:
                import llguidance.hf

                self._table = llguidance.hf.from_tokenizer(self._tokenizer.hf, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
            m = llguidance.LLMatcher(self._table, grammar, log_level=0)
            if m.is_error():
                raise BadRequestError(f"{field} cannot be compiled: {m.get_error()}")
            self._compiled[grammar] = m
            if len(self._compiled) > _CACHED:
                self._compiled.popitem(last=False)
            return m
