"""Several gateway processes on one port: `python -m gateway --processes N`.

One asyncio process translates every request and every block of every stream. When a burst of
requests ends in the same engine step and as many new ones arrive (closed-loop clients, or a
batch job), they queue behind each other in that one event loop, and each waits for the CPU
work of the others (at C = 32 on the H200 host, the larger part of what the stack added to the
time to first block). N processes take a share of the burst each.

The supervisor (`run`):
- binds N REST listening sockets on one port with SO_REUSEPORT (the kernel spreads new
  connections over them by address hash) and holds them for its whole life: a restarted child
  takes its socket back, and connections that arrived meanwhile wait in that socket's backlog
  instead of being refused;
- reserves the gRPC port (a bound socket with SO_REUSEPORT that never listens); every child
  binds its own gRPC server there with SO_REUSEPORT;
- points prometheus_client's multiprocess mode at a directory (PROMETHEUS_MULTIPROC_DIR when
  set, else a private temporary one), so /metrics in any child reports every child's latencies
  and counters (gateway/metrics.py);
- writes the API keys' rate-limit buckets to a file the children share (auth.SharedBuckets);
- starts the children (`python -m gateway`, the settings in CDE_* environment variables, never
  on a command line that other users can read), waits until each serves, restarts a child that
  dies (cde.supervision: the launcher's backoff; it gives up when one crash-loops), and on
  SIGTERM / SIGINT stops them all, each draining like a single gateway. A child whose supervisor
  is gone stops by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cde.supervision import CRASH_LOOP_WINDOW_S, recent_restarts, restart_delay
from gateway.auth import SharedBuckets, load_api_keys
from gateway.metrics import MULTIPROCESS_ENV
from gateway.server import GatewaySettings, check_settings, serve_until_signalled

log = logging.getLogger("gateway.processes")

# What a child finds in its environment (set by the supervisor only).
CHILD_SOCKET_ENV = "CDE_GATEWAY_LISTEN_FD"     # its REST listening socket
CHILD_READY_ENV = "CDE_GATEWAY_READY_FD"       # a pipe it writes one byte to once it serves
CHILD_BUCKETS_ENV = "CDE_GATEWAY_RATE_BUCKETS"  # the shared rate-limit buckets' file, if any

START_TIMEOUT_S = 180.0    # every child serving (loading the tokenizer, binding) within this
STOP_GRACE_S = 15.0        # after SIGTERM: uvicorn drains up to 5 s, gRPC 2 s
BACKLOG = 2048             # uvicorn's default


class StartError(RuntimeError):
    pass


def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, addr


def _refuse_if_taken(host: str, port: int, what: str) -> None:
    """Binding with SO_REUSEPORT succeeds next to another SO_REUSEPORT socket of the same user
    (another gateway): bind once without it first, so a port in use is an error, not shared."""
    family, addr = _address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # TIME_WAIT leftovers are fine
        try:
            probe.bind(addr)
        except OSError as e:
            raise StartError(f"cannot bind the {what} port {host}:{port}: {e.strerror}") from e


def _shared_socket(host: str, port: int, listen: bool) -> socket.socket:
    family, addr = _address(host, port)
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        if listen:
            s.listen(BACKLOG)
    except BaseException:
        s.close()
        raise
    return s


def listening_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """n REST sockets on one port (0 = a free one), SO_REUSEPORT, listening."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise StartError("--processes > 1 needs SO_REUSEPORT (Linux)")
    if port:
        _refuse_if_taken(host, port, "REST")
    socks = [_shared_socket(host, port, listen=True)]
    port = socks[0].getsockname()[1]
    try:
        socks += [_shared_socket(host, port, listen=True) for _ in range(n - 1)]
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def reserve_grpc_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket: holds the port (0 = a free one) for the
    children's gRPC servers, which bind it with SO_REUSEPORT too; it takes no connections."""
    if port:
        _refuse_if_taken(host, port, "gRPC")
    return _shared_socket(host, port, listen=False)


def child_environment(settings: GatewaySettings, metrics_dir: str, buckets: str | None) -> dict[str, str]:
    """The child's environment: every setting as CDE_<FIELD> (what `from_mapping` reads when no
    flag is given), one process each, the multiprocess metrics directory."""
    env = {k: v for k, v in os.environ.items() if k not in (CHILD_SOCKET_ENV, CHILD_READY_ENV, CHILD_BUCKETS_ENV)}
    for f in dataclasses.fields(GatewaySettings):
        env[f"CDE_{f.name.upper()}"] = str(getattr(settings, f.name))
    env["CDE_PROCESSES"] = "1"
    env[MULTIPROCESS_ENV] = metrics_dir
    if buckets:
        env[CHILD_BUCKETS_ENV] = buckets
    return env


@dataclasses.dataclass
class _Child:
    index: int
    sock: socket.socket
    proc: subprocess.Popen | None = None
    restarts: list[float] = dataclasses.field(default_factory=list)
    restart_at: float | None = None


class Supervisor:
    def __init__(self, settings: GatewaySettings) -> None:
        check_settings(settings)
        self.settings = settings
        self._stop = False
        self._work = Path(tempfile.mkdtemp(prefix="cde-gateway-"))   # 0700
        self.metrics_dir = os.environ.get(MULTIPROCESS_ENV) or str(self._work / "metrics")
        os.makedirs(self.metrics_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(self.metrics_dir, "*.db")):   # a previous run's values
            os.unlink(stale)
        buckets = None
        keys = load_api_keys(settings.api_keys_file or None, settings.api_keys or None)
        if keys and settings.rate_limit_rpm > 0:
            buckets = str(self._work / "rate_buckets")
            SharedBuckets.create(buckets, keys, settings.rate_limit_rpm)
        self.children: list[_Child] = []
        self.grpc_hold: socket.socket | None = None
        try:
            socks = listening_sockets(settings.host, settings.http_port, settings.processes)
            self.children = [_Child(i, s) for i, s in enumerate(socks)]
            self.http_port = socks[0].getsockname()[1]
            self.grpc_port = settings.grpc_port
            if settings.grpc_port >= 0:
                self.grpc_hold = reserve_grpc_port(settings.host, settings.grpc_port)
                self.grpc_port = self.grpc_hold.getsockname()[1]
        except BaseException:
            self.close()
            raise
        resolved = dataclasses.replace(settings, http_port=self.http_port, grpc_port=self.grpc_port)
        self._env = child_environment(resolved, self.metrics_dir, buckets)
        self._ready_r, self._ready_w = os.pipe()

    # ---- children ------------------------------------------------------------------------------
    def _spawn(self, child: _Child) -> None:
        fd = child.sock.fileno()
        env = dict(self._env, **{CHILD_SOCKET_ENV: str(fd), CHILD_READY_ENV: str(self._ready_w)})
        child.proc = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, pass_fds=(fd, self._ready_w))
        child.restart_at = None

    def start(self) -> None:
        """Every child started and serving, else StartError (with everything stopped)."""
        for child in self.children:
            self._spawn(child)
        ready, deadline = 0, time.monotonic() + START_TIMEOUT_S
        while ready < len(self.children):
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None:
                    raise StartError(f"gateway process {child.index} exited with {child.proc.returncode} while starting")
            if self._stop:
                raise StartError("stopped while starting")
            if time.monotonic() > deadline:
                raise StartError(f"{len(self.children) - ready} gateway processes not serving after {START_TIMEOUT_S:.0f} s")
            ready += self._read_ready(0.2)
        log.info("gateway: %d processes serving REST on %s:%d, gRPC on %s", len(self.children), self.settings.host,
                 self.http_port, self.grpc_port if self.grpc_port >= 0 else "-")

    def _read_ready(self, timeout: float) -> int:
        r, _, _ = select.select([self._ready_r], [], [], timeout)
        return len(os.read(self._ready_r, 4096)) if r else 0

    def supervise(self) -> int:
        """Restart dead children until told to stop (0) or one crash-loops (1)."""
        while not self._stop:
            now = time.monotonic()
            for child in self.children:
                proc = child.proc
                if proc is not None and proc.poll() is not None:
                    self._mark_dead(proc.pid)
                    recent = recent_restarts(child.restarts, now)
                    delay = restart_delay(recent)
                    if delay is None:
                        log.error("gateway process %d keeps dying (%d restarts in %.0f s); stopping", child.index,
                                  recent, CRASH_LOOP_WINDOW_S)
                        return 1
                    log.warning("gateway process %d (pid %d) exited with %d; restarting in %.0f s", child.index,
                                proc.pid, proc.returncode, delay)
                    child.proc, child.restart_at = None, now + delay
                    child.restarts.append(now)
                if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                    self._spawn(child)
            self._read_ready(0.2)   # drain restarted children's ready bytes; doubles as the tick
        return 0

    def _mark_dead(self, pid: int) -> None:
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, self.metrics_dir)   # its live gauges (in flight) go

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def stop(self) -> None:
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.close()

    def close(self) -> None:
        for child in self.children:
            child.sock.close()
        if self.grpc_hold is not None:
            self.grpc_hold.close()
        for fd in (getattr(self, "_ready_r", None), getattr(self, "_ready_w", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._ready_r = self._ready_w = None
        shutil.rmtree(self._work, ignore_errors=True)


def run(settings: GatewaySettings) -> int:
    """The supervisor's life; its exit status."""
    try:
        sup = Supervisor(settings)
    except (StartError, OSError) as e:
        log.error("%s", e)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, sup.request_stop)
    try:
        sup.start()
        return sup.supervise()
    except StartError as e:
        log.error("%s", e)
        return 1
    finally:
        sup.stop()


# ---- a child ---------------------------------------------------------------------------------
def is_child() -> bool:
    return CHILD_SOCKET_ENV in os.environ


async def _supervisor_gone() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("gateway supervisor (pid %d) is gone; stopping", parent)


def child_main() -> None:
    """One of the supervisor's children: the settings from CDE_* variables, its socket inherited."""
    settings = GatewaySettings.from_mapping({})
    sock = socket.socket(fileno=int(os.environ.pop(CHILD_SOCKET_ENV)))
    ready_fd = int(os.environ.pop(CHILD_READY_ENV))
    buckets_file = os.environ.pop(CHILD_BUCKETS_ENV, None)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")

    def ready() -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    asyncio.run(serve_until_signalled(settings, on_ready=ready, stop_when=_supervisor_gone(),
                                      http_socket=sock, share_grpc_port=True,
                                      rate_buckets=SharedBuckets(buckets_file) if buckets_file else None))
