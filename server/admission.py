"""Admission control of on-demand scoring: a bounded budget of prompt tokens in flight.

A request of ``n`` tokens is admitted iff nothing is in flight or ``in_flight + n <= limit``,
else refused at once with ``Retry-After = ceil(in_flight / rate)`` seconds in ``[1, 60]``, the
rate being the tokens of the requests finished in the last :data:`RATE_WINDOW_S` seconds over
the wall time since the earliest of them started. Used from the app's event loop only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

#: Seconds of finished requests the drain rate is measured over.
RATE_WINDOW_S = 30.0


class TokenGate:
    """The on-demand token budget (see module docstring)."""

    def __init__(self, limit: int, *, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.in_flight = 0
        self.requests = 0
        self.refused = 0
        self._clock = clock
        self._done: deque[tuple[float, float, int]] = deque()  # (finished, started, tokens)

    def try_acquire(self, tokens: int) -> bool:
        """Admit ``tokens`` (True) or refuse (False); an admitted amount must be released."""
        if self.in_flight and self.in_flight + tokens > self.limit:
            self.refused += 1
            return False
        self.in_flight += tokens
        self.requests += 1
        return True

    def release(self, tokens: int, seconds: float | None = None) -> None:
        """Give back ``tokens``; with ``seconds`` (the wall time the request took, admitted to
        finished) its work counts toward the drain rate."""
        self.in_flight = max(0, self.in_flight - tokens)
        self.requests = max(0, self.requests - 1)
        if seconds is not None and seconds > 0 and tokens > 0:
            now = self._clock()
            self._done.append((now, now - seconds, tokens))

    @property
    def rate(self) -> float | None:
        """Tokens/s the queue drained at over the last :data:`RATE_WINDOW_S` seconds (None
        before the first finished request)."""
        now = self._clock()
        while len(self._done) > 1 and self._done[0][0] < now - RATE_WINDOW_S:
            self._done.popleft()  # the newest stays: the last rate seen, when idle since
        if not self._done:
            return None
        start = min(started for _, started, _ in self._done)
        span = max(now, self._done[-1][0]) - start
        return sum(t for _, _, t in self._done) / span if span > 0 else None

    def retry_after(self) -> int:
        """Seconds a refused client should wait (see module docstring)."""
        rate = self.rate
        if not rate:
            return 1
        return int(min(60, max(1, math.ceil(self.in_flight / rate))))
