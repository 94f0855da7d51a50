"""StreamingLLM's KV layout (Xiao et al. 2023; ``EngineConfig.attention_window`` and ``sink_tokens``): a
sequence keeps the KV of its first ``sink`` tokens and of its most recent ``size - sink`` tokens, ``size`` slots in
all, so generation goes on past the window with constant KV memory.

Slots ``0 .. sink-1`` hold the sink tokens; the others form a ring: position p >= size lands in slot
``sink + (p - sink) mod (size - sink)``, overwriting the token that just left the window. Keys are stored rotated
at their original positions (RoPE is applied before the write), so a query attends to whatever the slots hold in
any order: the decode kernels need only the number of filled slots, ``min(context, size)``. A token at position q
thus attends to keys k <= q with k < sink or k > q - (size - sink); while the whole sequence fits (q < size) that
is ordinary causal attention. Past the window, tokens are computed one a step (a prompt chunk would overwrite slots
its own earlier rows still need).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVWindow:
    size: int  # KV slots a sequence keeps, the sink tokens included
    sink: int  # leading tokens always kept

    def kept(self, num_tokens: int) -> int:
        """KV slots a sequence of num_tokens tokens fills."""
        return min(num_tokens, self.size)

    def slot(self, position: int) -> int:
        """The sequence-relative KV slot of the token at position."""
        if position < self.size:
            return position
        return self.sink + (position - self.sink) % (self.size - self.sink)

    def chunk_limit(self, num_computed: int) -> int:
        """Tokens a sequence may compute in one step from num_computed on: up to the window, then one at a time."""
        return self.size - num_computed if num_computed < self.size else 1
