"""Optional API keys with a per-key token-bucket rate limit. Off unless keys are configured.

Keys come from a file (one per line, '#' comments) and/or CDE_API_KEYS (comma-separated).
Comparison is constant-time so response timing does not leak key prefixes. The bucket lives in
process memory: with several gateway replicas each enforces its own share, which is enough for
"don't let one client flood the queue" (the scheduler's admission control is the real guard).
The processes of one gateway (`--processes`) share their buckets through `SharedBuckets`, a
small file they all map, so one client is held to the configured rate whichever process its
connections land on.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import math
import mmap
import os
import struct
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
        self.tokens, wait = _refill(self.tokens, self.stamp, now, self.rate_per_min)
        self.stamp = now
        return wait


def _refill(tokens: float, stamp: float, now: float, rate_per_min: float) -> tuple[float, float]:
    """A bucket's (tokens, wait seconds) after one take at `now`; wait 0.0 = the request may go."""
    per_s = rate_per_min / 60.0
    tokens = min(rate_per_min, tokens + (now - stamp) * per_s)
    if tokens >= 1.0:
        return tokens - 1.0, 0.0
    return tokens, (1.0 - tokens) / per_s


class SharedBuckets:
    """One token bucket per API key in a file that every process of a gateway maps: per key its
    SHA-256 (the key itself is never written), tokens and the CLOCK_MONOTONIC stamp of the last
    take (one clock for every process of a host). A take locks the file (flock) around its
    read-modify-write. `create` writes the file once, in the supervisor, every bucket full."""

    _SLOT = struct.Struct("<32sdd")

    @classmethod
    def create(cls, path: str | Path, keys: Iterable[str], rate_per_min: float) -> None:
        now = time.monotonic()
        digests = sorted({hashlib.sha256(k.encode()).digest() for k in keys})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(cls._SLOT.pack(d, rate_per_min, now) for d in digests) or b"\0" * cls._SLOT.size)

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "r+b")   # noqa: SIM115 - mapped for the process's life
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._slot: dict[bytes, int] = {}
        for i in range(len(self._map) // self._SLOT.size):
            digest = self._SLOT.unpack_from(self._map, i * self._SLOT.size)[0]
            self._slot.setdefault(digest, i * self._SLOT.size)

    def take(self, key: bytes, rate_per_min: float) -> float | None:
        """As TokenBucket.take; None when the file has no bucket for this key (a key added to the
        keys file after the gateway started: that process then keeps a bucket of its own)."""
        offset = self._slot.get(hashlib.sha256(key).digest())
        if offset is None:
            return None
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            digest, tokens, stamp = self._SLOT.unpack_from(self._map, offset)
            now = time.monotonic()
            tokens, wait = _refill(tokens, stamp, now, rate_per_min)
            self._SLOT.pack_into(self._map, offset, digest, tokens, now)
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        return wait


class ApiKeyAuth:
    """`check(authorization_header)` raises GatewayError (401 / 429) or returns the key."""

    def __init__(self, keys: Iterable[str], rate_per_min: float = 0.0, shared: SharedBuckets | None = None) -> None:
        self.keys = [k.encode() for k in keys]
        self.rate_per_min = rate_per_min
        self._shared = shared   # the buckets of every process of this gateway, else this process's
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
            wait = self._shared.take(match, self.rate_per_min) if self._shared is not None else None
            if wait is None:
                wait = self._buckets.setdefault(match, TokenBucket(self.rate_per_min)).take()
            if wait > 0:
                raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"rate limit of {self.rate_per_min:g} requests/min for this API key exceeded",
                                   err_code="rate_limit_exceeded", retry_after_ms=math.ceil(wait * 1000))
        return match.decode()
