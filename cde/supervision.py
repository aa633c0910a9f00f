"""When a supervised process that died is started again: the launcher's services (cde.launch)
and a multi-process gateway's children (gateway/processes.py) follow the same policy.

After 1 s, doubling per restart within the window, up to 30 s; a process restarted 5 times
within 60 s crash-loops, and its supervisor gives up instead of restarting it again."""

from __future__ import annotations

RESTART_BACKOFF_S = (1.0, 30.0)
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0


def recent_restarts(restarts: list[float], now: float) -> int:
    """How many of `restarts` (time.monotonic() stamps) fall within the crash-loop window."""
    return sum(1 for t in restarts if now - t < CRASH_LOOP_WINDOW_S)


def restart_delay(recent: int) -> float | None:
    """Seconds to wait before the next restart after `recent` ones in the window; None: the
    process crash-loops."""
    if recent >= CRASH_LOOP_RESTARTS:
        return None
    first, most = RESTART_BACKOFF_S
    return min(first * 2 ** recent, most)
