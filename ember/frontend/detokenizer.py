"""Incremental, UTF-8-safe detokenization and stop-string handling for one sequence.

Decoding token by token breaks characters that span several byte-level tokens (emoji, CJK). As vLLM and
transformers' TextStreamer do, we decode a short window of recent tokens and only release text once it no longer
ends in an incomplete character (U+FFFD). Text that might be the start of a stop string is held back too, so a
stop string never leaks into a streamed delta.
"""

from __future__ import annotations

from ember.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # tokens of left context so that leading spaces and merges decode as in the full text


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "emitted", "stop", "hold",
                 "skip_special_tokens", "include_stop")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all generated text so far, stop string not yet cut
        self.emitted = 0  # characters of self.text already released
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; return the stop string it completed, if any (and cut the text there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.hold)
            self.text += new
            for s in self.stop if check_stop else ():
                pos = self.text.find(s, start)
                if pos != -1:
                    self.text = self.text[:pos + len(s) if self.include_stop else pos]
                    return s
        return None

    def delta(self, finished: bool) -> str:
        """Text that is safe to release now; everything that is left once the sequence finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def flush_incomplete(self) -> None:
        """At the end, keep a trailing incomplete character as U+FFFD, as a full decode would."""
        tail = self._decode(self.ids[self.prefix_offset:])
        head = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(tail) > len(head):
            self.text += tail[len(head):]
