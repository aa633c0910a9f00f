"""The system with replicated services, as the launcher runs it (cde.launch.Stack, real processes
on loopback): N schedulers sharing one lease in Redis, M workers and the gateway given every
scheduler address, K attribution replicas, steering; Redis a plain AOF server, or with
``redis_ha`` a master + replica + three sentinels (``cde.launch --ha``).

    with ha_stack(tmp_path, schedulers=2, workers=2) as stack:
        active = active_scheduler(stack)     # the Service holding the lease
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import redis

from cde.launch import TINY_MODEL, Service, Stack
from tests.stack_fixture import running_stack


@contextlib.contextmanager
def ha_stack(run_dir: str | Path, *, schedulers: int = 2, workers: int = 2, attributions: int = 1,
             lease_ms: int = 1500, redis_ha: bool = False, timeout: float = 240.0,
             model_dir: str | Path = TINY_MODEL) -> Iterator[Stack]:
    with running_stack(run_dir, workers=workers, schedulers=schedulers, attribution_replicas=attributions,
                       ha=redis_ha, scheduler_args=["--lease-ms", str(lease_ms)], timeout=timeout,
                       model_dir=model_dir) as stack:
        yield stack


def active_scheduler(stack: Stack) -> tuple[Service, int]:
    """The scheduler process holding the lease, and its fencing token."""
    value = redis.Redis.from_url(stack.redis_url).get("cde:leader")
    assert value, "no scheduler holds the lease"
    token, instance, _ = value.decode().split("|")
    return next(s for s in stack.services if s.name == f"scheduler{instance[1:]}"), int(token)
