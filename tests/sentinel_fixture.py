"""Redis HA on loopback for tests: cde.redis_ha.RedisHa (a master, a replica and three
sentinels, real ``redis-server`` processes, AOF ``appendfsync always``), stopped afterwards.

    with sentinel_group(tmp_path) as g:
        g.sentinels        # [(host, port)] x 3, monitoring "mymaster" (quorum 2)
        g.master, g.replica   # EmbeddedRedis, as the sentinels name them now
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from cde.redis_ha import MASTER_NAME, RedisHa

__all__ = ["MASTER_NAME", "sentinel_group"]


@contextlib.contextmanager
def sentinel_group(run_dir: Path, down_after_ms: int = 1000) -> Iterator[RedisHa]:
    group = RedisHa(run_dir, down_after_ms=down_after_ms).start()
    try:
        yield group
    finally:
        group.stop()
