"""Stored responses (``store: true``), bounded in number and in bytes, the least recently used dropped first.

A stored response keeps its body (what ``GET /v1/responses/{id}`` answers) and the conversation that produced it,
as chat messages (its instructions excluded, as OpenAI does), so that a next turn naming it in
``previous_response_id`` renders the same prompt tokens and the prefix cache serves them. A background response
also keeps its run, so that a cancel can abort its engine requests (which frees their KV blocks).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object, updated while a background response runs
    conversation: list[dict[str, Any]]  # chat messages: the history, this turn's input, this turn's output
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this turn's input items, as given
    run: Any = None  # a background response at work: its ``BackgroundRun`` (None once it ended)

    def size(self) -> int:
        return len(json.dumps([self.body, self.conversation, self.input_items], default=str))


class ResponseStore:
    """id -> StoredResponse; at most ``max_responses`` of them and ``max_bytes`` of their JSON together."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError(f"response store bounds ({max_responses}, {max_bytes}) must be >= 0")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        return entry[0]

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store (or re-store after an update, with its new size); the least recently used go until the bounds
        hold. A response larger than the whole byte bound is not kept (a running one is, until it ends)."""
        self.delete(response_id)
        size = stored.size()
        if (size > self.max_bytes or self.max_responses == 0) and stored.run is None:
            return
        self._items[response_id] = (stored, size)
        self.bytes += size
        # the oldest go first, but never a background response at work (its cancel must find it): the bounds may
        # be passed while only running ones are left, until they end
        for old in [k for k, (s, _) in self._items.items() if s.run is None]:
            if len(self._items) <= self.max_responses and self.bytes <= self.max_bytes:
                break
            self.delete(old)

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry[1]
        return True
