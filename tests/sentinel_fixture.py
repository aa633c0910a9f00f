"""Redis HA on loopback for tests: a master, a replica and three sentinels, all real
``redis-server`` processes (the binary the tests already use; ``--sentinel`` mode).

    with sentinel_group(tmp_path) as g:
        g.sentinels        # [(host, port)] x 3, monitoring "mymaster" (quorum 2)
        g.master, g.replica   # EmbeddedRedis; g.current_master() asks the sentinels

The master and the replica both run AOF with ``appendfsync always``. Sentinels judge a
master down after ``down_after_ms`` (1 s), so a failover completes within a few seconds.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from cde.redis_util import LOOPBACK, EmbeddedRedis, free_port, redis_server_binary

MASTER_NAME = "mymaster"


@dataclass
class SentinelGroup:
    master: EmbeddedRedis
    replica: EmbeddedRedis
    sentinels: list[tuple[str, int]]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def ask(self, *cmd):
        """The first sentinel that answers ``cmd``."""
        last = None
        for host, port in self.sentinels:
            try:
                return redis.Redis(host=host, port=port, socket_timeout=1).execute_command(*cmd)
            except redis.RedisError as e:
                last = e
        raise AssertionError(f"no sentinel answered {cmd}: {last}")

    def current_master(self) -> tuple[str, int]:
        host, port = self.ask("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
        return host.decode(), int(port)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def _link_up(replica: EmbeddedRedis) -> bool:
    info = redis.Redis(host=LOOPBACK, port=replica.port).info("replication")
    return info.get("master_link_status") == "up"


@contextlib.contextmanager
def sentinel_group(run_dir: Path, down_after_ms: int = 1000) -> Iterator[SentinelGroup]:
    run_dir.mkdir(parents=True, exist_ok=True)
    master = EmbeddedRedis(data_dir=run_dir / "master", aof=True, appendfsync="always")
    replica = None
    procs: list[subprocess.Popen] = []
    try:
        master.start()
        replica = EmbeddedRedis(data_dir=run_dir / "replica", aof=True, appendfsync="always",
                                extra_args=["--replicaof", LOOPBACK, str(master.port)]).start()
        _wait(lambda: _link_up(replica), 10, "the replica's link to the master")
        sentinels = []
        for i in range(3):
            port = free_port()
            d = run_dir / f"sentinel{i}"
            d.mkdir(exist_ok=True)
            conf = d / "sentinel.conf"   # sentinel rewrites its config: one file each
            conf.write_text(f"port {port}\nbind {LOOPBACK}\ndir {d}\n"
                            f"sentinel monitor {MASTER_NAME} {LOOPBACK} {master.port} 2\n"
                            f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
                            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                            f"sentinel parallel-syncs {MASTER_NAME} 1\n")
            log = (d / "sentinel.log").open("wb")
            procs.append(subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=d,
                                          start_new_session=True))
            sentinels.append((LOOPBACK, port))
        group = SentinelGroup(master, replica, sentinels, procs)

        def ready() -> bool:
            try:
                for host, port in sentinels:
                    s = redis.Redis(host=host, port=port, socket_timeout=1)
                    if not s.execute_command("SENTINEL", "replicas", MASTER_NAME):
                        return False
                    if len(s.execute_command("SENTINEL", "sentinels", MASTER_NAME)) < 2:
                        return False
                return True
            except redis.RedisError:
                return False
        _wait(ready, 20, "3 sentinels that know the replica and each other")
        yield group
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=5)
        if replica is not None:
            replica.stop()
        master.stop()
