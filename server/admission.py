"""Admission control of on-demand scoring: a bounded budget of prompt tokens in flight.

Contract: a request of ``n`` prompt tokens is admitted iff nothing is in flight or
``in_flight + n <= limit``; otherwise it is refused at once (no queueing in the server, the
client retries after ``Retry-After`` seconds). A single request larger than the whole budget
still runs when it is alone, so no valid request is refused forever.

``Retry-After`` is the time the engine needs to work off what is in flight at the throughput
observed over recent requests: ``ceil(in_flight / rate)`` seconds, clamped to ``[1, 60]``
(``1`` before any request has finished). The rate is an exponentially weighted average of
tokens/s of finished engine calls (weight ``alpha`` on the newest), so it follows load changes.

Single event loop only (no locks): every method is called from the app's loop.
"""

from __future__ import annotations

import math


class TokenGate:
    """The on-demand token budget (see module docstring)."""

    def __init__(self, limit: int, *, alpha: float = 0.3):
        self.limit = limit
        self.in_flight = 0
        self.requests = 0
        self.refused = 0
        self._alpha = alpha
        self._rate: float | None = None

    def try_acquire(self, tokens: int) -> bool:
        """Admit ``tokens`` (True) or refuse (False); an admitted amount must be released."""
        if self.in_flight and self.in_flight + tokens > self.limit:
            self.refused += 1
            return False
        self.in_flight += tokens
        self.requests += 1
        return True

    def release(self, tokens: int, seconds: float | None = None) -> None:
        """Give back ``tokens``; with ``seconds`` (the engine time they took) update the rate."""
        self.in_flight = max(0, self.in_flight - tokens)
        self.requests = max(0, self.requests - 1)
        if seconds is not None and seconds > 0 and tokens > 0:
            rate = tokens / seconds
            self._rate = (
                rate
                if self._rate is None
                else (self._alpha * rate + (1 - self._alpha) * self._rate)
            )

    @property
    def rate(self) -> float | None:
        """Observed tokens/s (None before the first finished request)."""
        return self._rate

    def retry_after(self) -> int:
        """Seconds a refused client should wait (see module docstring)."""
        if not self._rate:
            return 1
        return int(min(60, max(1, math.ceil(self.in_flight / self._rate))))
