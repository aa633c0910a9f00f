"""Redis HA on one machine: a master, a replica and three sentinels, all real ``redis-server``
processes on loopback (``--sentinel`` mode for the sentinels), for ``cde.launch --ha`` and the
tests.

    group = RedisHa(run_dir / "redis").start()
    group.sentinels            # [(host, port)] x 3, monitoring "mymaster" (quorum 2)
    group.current_master()     # (host, port), as the sentinels say
    group.supervise()          # restart what died: a data node as a replica of the current master

Both data nodes run AOF. Sentinels judge a master down after ``down_after_ms``; with the default
1 s a failover completes in a few seconds. Each sentinel has its own config file, which it
rewrites as the group changes, so a restarted sentinel knows the current master.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from cde.redis_util import LOOPBACK, EmbeddedRedis, free_port, redis_server_binary

__all__ = ["MASTER_NAME", "RedisHa"]

MASTER_NAME = "mymaster"


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _link_up(node: EmbeddedRedis) -> bool:
    try:
        info = redis.Redis(host=LOOPBACK, port=node.port, socket_timeout=1).info("replication")
    except redis.RedisError:
        return False
    return info.get("master_link_status") == "up"


class _Sentinel:
    def __init__(self, run_dir: Path, master_port: int, down_after_ms: int, quorum: int):
        self.port = free_port()
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text(f"port {self.port}\nbind {LOOPBACK}\ndir {self.dir}\n"
                             f"sentinel monitor {MASTER_NAME} {LOOPBACK} {master_port} {quorum}\n"
                             f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
                             f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                             f"sentinel parallel-syncs {MASTER_NAME} 1\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with (self.dir / "sentinel.log").open("ab") as log:
            self.proc = subprocess.Popen([redis_server_binary(), str(self.conf), "--sentinel"], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
                                         start_new_session=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=5)


class RedisHa:
    """The group; ``nodes[0]`` starts as the master, ``nodes[1]`` as its replica."""

    def __init__(self, run_dir: str | Path, *, down_after_ms: int = 1000, appendfsync: str = "always",
                 n_sentinels: int = 3, quorum: int = 2):
        self.run_dir = Path(run_dir)
        self.down_after_ms = down_after_ms
        self.appendfsync = appendfsync
        self.n_sentinels = n_sentinels
        self.quorum = quorum
        self.nodes: list[EmbeddedRedis] = []
        self._sentinels: list[_Sentinel] = []

    # ------------------------------------------------------------------ info
    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, s.port) for s in self._sentinels]

    @property
    def sentinel_arg(self) -> str:
        """``--redis-sentinels`` for a service."""
        return ",".join(f"{h}:{p}" for h, p in self.sentinels)

    @property
    def master(self) -> EmbeddedRedis:
        """The data node the sentinels name as master now."""
        _, port = self.current_master()
        return next(n for n in self.nodes if n.port == port)

    @property
    def replica(self) -> EmbeddedRedis:
        """The data node that is not the master now."""
        _, port = self.current_master()
        return next(n for n in self.nodes if n.port != port)

    def ask(self, *cmd):
        """The first sentinel that answers ``cmd``."""
        last = None
        for host, port in self.sentinels:
            try:
                return redis.Redis(host=host, port=port, socket_timeout=1).execute_command(*cmd)
            except redis.RedisError as e:
                last = e
        raise redis.ConnectionError(f"no sentinel answered {cmd}: {last}")

    def current_master(self) -> tuple[str, int]:
        host, port = self.ask("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
        return host.decode(), int(port)

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 20.0) -> "RedisHa":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            master = EmbeddedRedis(data_dir=self.run_dir / "node0", aof=True, appendfsync=self.appendfsync).start()
            self.nodes = [master]
            replica = EmbeddedRedis(data_dir=self.run_dir / "node1", aof=True, appendfsync=self.appendfsync,
                                    extra_args=["--replicaof", LOOPBACK, str(master.port)]).start()
            self.nodes.append(replica)
            _wait(lambda: _link_up(replica), timeout, "the replica's link to the master")
            self._sentinels = [_Sentinel(self.run_dir / f"sentinel{i}", master.port, self.down_after_ms, self.quorum)
                               for i in range(self.n_sentinels)]
            for s in self._sentinels:
                s.start()
            _wait(self._sentinels_ready, timeout, f"{self.n_sentinels} sentinels that know the replica and each other")
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinels_ready(self) -> bool:
        try:
            for host, port in self.sentinels:
                s = redis.Redis(host=host, port=port, socket_timeout=1)
                if not s.execute_command("SENTINEL", "replicas", MASTER_NAME):
                    return False
                if len(s.execute_command("SENTINEL", "sentinels", MASTER_NAME)) < self.n_sentinels - 1:
                    return False
            return True
        except redis.RedisError:
            return False

    def supervise(self) -> list[str]:
        """Restart what died; what was done, one line each. A data node comes back as a replica
        of the master the sentinels name now (never as a second master with stale data); while
        no master is known (a failover in progress) a dead data node waits for the next round."""
        done = []
        for i, s in enumerate(self._sentinels):
            if not s.running():
                s.start()
                done.append(f"sentinel{i} died; restarted")
        for i, node in enumerate(self.nodes):
            if node.running():
                continue
            try:
                host, port = self.current_master()
            except redis.RedisError:
                continue
            if port == node.port:   # the sentinels have not yet noticed: wait for the failover
                continue
            node.extra_args = ["--replicaof", host, str(port)]
            node.restart()
            done.append(f"node{i} died; restarted as a replica of {host}:{port}")
        return done

    def stop(self) -> None:
        for s in self._sentinels:
            s.kill()
        for node in self.nodes:
            node.stop()
