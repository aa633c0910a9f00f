"""gRPC transport settings every cde server and channel share: message limits, keepalive and
reconnect backoff (`server_options`, `channel_options`).

Kept apart from cde/rpc/__init__.py so that cde.rpc.internal_auth, which cde.rpc uses to build
servers, can build channels without importing cde.rpc back.
"""

from __future__ import annotations

from typing import Any

# Largest message any cde.v1 service sends or accepts. The biggest legitimate payloads are
# well under 1 MiB (a relu mask of the 8B model: 392 KiB; a committed block's raw concept
# records: ~80 KiB), so 8 MiB leaves room without letting one bad message eat the memory.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# Clients ping every 30 s (also when idle, so a dead peer is noticed between requests);
# servers accept pings that often and ping back every 60 s.
_CLIENT_KEEPALIVE_MS = 30_000
_SERVER_KEEPALIVE_MS = 60_000
_KEEPALIVE_TIMEOUT_MS = 10_000


def _limits(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, share_port: bool = False) -> list[tuple[str, Any]]:
    """share_port: the processes of one multi-process gateway bind the same port (SO_REUSEPORT)."""
    return _limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", _SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _CLIENT_KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        # a second server on the same port must fail, not share it (gRPC takes an option's first value)
        ("grpc.so_reuseport", int(share_port)),
    ]


# Reconnect backoff between services: gRPC's default grows to 120 s, so a peer that was down
# for a minute is only dialled again seconds after it is back. Capped at 0.5 s (gRPC adds up to
# 20 % jitter), a restarted scheduler is seen by the gateway and the workers within 0.6 s plus
# the connect; dialling a dead loopback or cluster peer twice a second costs nothing.
_INITIAL_RECONNECT_BACKOFF_MS = 100
_MAX_RECONNECT_BACKOFF_MS = 500


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return _limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", _CLIENT_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ]
