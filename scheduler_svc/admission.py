"""Admission control: how many requests this scheduler takes on, and when to come back.

A request is *live* from admission until it ends; at most ``max_running`` live requests
are placed on workers at once, the rest wait (at most ``max_queue`` of them). A Submit
beyond that is refused with RESOURCE_EXHAUSTED and a retry hint, computed from how fast
requests have been finishing: the queue drains about ``max_running`` requests per mean
request time, so a client that is ``n`` places over the limit should come back after
about ``n * mean / max_running``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_RETRY_MS = 100
MAX_RETRY_MS = 60_000


@dataclass
class Admission:
    max_running: int
    max_queue: int
    mean_request_s: float = 2.0    # prior, until the first requests finish
    _ewma_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")

    @property
    def limit(self) -> int:
        return self.max_running + self.max_queue

    def retry_after_ms(self, live: int) -> int | None:
        """None when a new request may come in now, else the hint in milliseconds."""
        over = live - self.limit + 1
        if over <= 0:
            return None
        ms = 1000.0 * over * self.mean_request_s / self.max_running
        return int(min(max(ms, MIN_RETRY_MS), MAX_RETRY_MS))

    def observe(self, seconds: float) -> None:
        """A request took ``seconds`` from admission to its end."""
        if seconds >= 0:
            self.mean_request_s += self._ewma_weight * (seconds - self.mean_request_s)
