"""A bound on what the server holds: at most ``capacity`` engine requests in flight (the engine's running seats
plus a waiting queue). Past it a request is answered 503 at once with a Retry-After, so a flood of clients costs
a refused connection each, not memory."""

from __future__ import annotations

import math
import time
from collections import deque

from ember.server.errors import APIError

_RATE_WINDOW_S = 10.0


class Admission:
    """Used from the event loop's thread only (no lock)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.closed = False  # shutting down: nothing new is admitted
        self._finished: deque[float] = deque(maxlen=1024)  # when recent requests left, for the retry estimate

    def enter(self, k: int = 1) -> None:
        if self.closed:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.in_flight + k > self.capacity:
            raise APIError(503, f"the server is at capacity ({self.capacity} requests running or queued): retry "
                                f"after {self.retry_after()} s", code="server_overloaded",
                           headers={"Retry-After": str(self.retry_after())})
        self.in_flight += k

    def leave(self, k: int = 1) -> None:
        self.in_flight -= k
        now = time.monotonic()
        self._finished.extend([now] * min(k, 64))

    def retry_after(self) -> int:
        """Seconds until a seat is likely free: one queue's worth of requests at the recent completion rate."""
        now = time.monotonic()
        recent = sum(1 for t in self._finished if now - t <= _RATE_WINDOW_S)
        if not recent:
            return 1
        return max(1, min(60, math.ceil((self.in_flight - self.capacity + 1) / (recent / _RATE_WINDOW_S))))
