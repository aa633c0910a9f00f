"""Optional API keys with a per-key token-bucket rate limit. Off unless keys are configured.

Keys come from a file (one per line, '#' comments) and/or CDE_API_KEYS (comma-separated).
Comparison is constant-time so response timing does not leak key prefixes. The bucket lives in
process memory: with several gateway replicas each enforces its own share, which is enough for
"don't let one client flood the queue" (the scheduler's admission control is the real guard).
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway.errors import GatewayError


def load_api_keys(path: str | Path | None, env_value: str | None) -> list[str]:
    keys: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if env_value:
        keys += [k.strip() for k in env_value.split(",") if k.strip()]
    return keys


@dataclass
class TokenBucket:
    rate_per_min: float
    tokens: float = field(init=False)
    stamp: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.rate_per_min  # a full minute's burst

    def take(self) -> float:
        """0.0 when a request may go now, else the seconds until one token refills."""
        now = time.monotonic()
        per_s = self.rate_per_min / 60.0
        self.tokens = min(self.rate_per_min, self.tokens + (now - self.stamp) * per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / per_s


class ApiKeyAuth:
    """`check(authorization_header)` raises GatewayError (401 / 429) or returns the key."""

    def __init__(self, keys: Iterable[str], rate_per_min: float = 0.0) -> None:
        self.keys = [k.encode() for k in keys]
        self.rate_per_min = rate_per_min
        self._buckets: dict[bytes, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str | None:
        if not self.enabled:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        match = None
        for k in self.keys:  # check every key: constant time in the key set too
            if hmac.compare_digest(k, presented):
                match = k
        if not presented or match is None:
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing or invalid API key: send 'Authorization: Bearer <key>'",
                               err_code="invalid_api_key")
        if self.rate_per_min > 0:
            bucket = self._buckets.setdefault(match, TokenBucket(self.rate_per_min))
            wait = bucket.take()
            if wait > 0:
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"rate limit of {self.rate_per_min:g} requests/min for this API key exceeded",
                                   err_code="rate_limit_exceeded", retry_after_ms=math.ceil(wait * 1000))
        return match.decode()
