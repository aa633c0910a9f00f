"""The system with replicated services, as real processes on loopback, for the HA tests:
N schedulers (one lease in Redis), M workers and the gateway given every scheduler address,
K attribution replicas, steering, and a real redis-server (AOF, appendfsync always).

It builds on cde.launch.Stack (its wait_healthy, stop and log helpers): only the service
list differs.

    with ha_stack(tmp_path, schedulers=2, workers=2) as stack:
        active = active_scheduler(stack)     # the Service holding the lease
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis

from cde.launch import ROOT, TINY_MODEL, Service, Stack
from cde.redis_util import EmbeddedRedis, free_port
from tests.stack_fixture import print_log_tails, stack_args

PY = [sys.executable, "-m"]


def _services(model: str, ports: dict, n_sched: int, n_workers: int, n_attr: int, lease_ms: int,
              scheduler_args: Sequence[str]) -> list[Service]:
    sched_addrs = ",".join(f"127.0.0.1:{ports[f'scheduler{i}']}" for i in range(n_sched))
    attr = ",".join(f"127.0.0.1:{ports[f'attribution{i}']}" for i in range(n_attr))
    out = [Service("steering", PY + ["steering_svc", "--model-dir", model, "--host", "127.0.0.1",
                                     "--port", str(ports["steering"])], grpc_port=ports["steering"])]
    out += [Service(f"attribution{i}", PY + ["attribution_svc", "--model-dir", model, "--host", "127.0.0.1",
                                             "--port", str(ports[f"attribution{i}"])],
                    grpc_port=ports[f"attribution{i}"]) for i in range(n_attr)]
    out += [Service(f"scheduler{i}", PY + ["scheduler_svc", "--host", "127.0.0.1", "--port",
                                           str(ports[f"scheduler{i}"]), "--scheduler-id", f"s{i}",
                                           "--lease-ms", str(lease_ms),
                                           *(["--attribution", attr] if attr else []), *scheduler_args],
                    grpc_port=ports[f"scheduler{i}"]) for i in range(n_sched)]
    out += [Service(f"worker{i}", PY + ["worker_svc", "--model-dir", model, "--host", "127.0.0.1",
                                        "--port", str(ports[f"worker{i}"]), "--scheduler", sched_addrs,
                                        "--worker-id", f"w{i}", "--device", "cpu", "--threads", "1"],
                    grpc_port=ports[f"worker{i}"]) for i in range(n_workers)]
    out.append(Service("gateway", PY + ["gateway", "--model-dir", model, "--host", "127.0.0.1",
                                        "--http-port", str(ports["gateway_http"]), "--grpc-port",
                                        str(ports["gateway_grpc"]), "--scheduler", sched_addrs,
                                        "--steering", f"127.0.0.1:{ports['steering']}"],
                       http_port=ports["gateway_http"], grpc_port=ports["gateway_grpc"]))
    return out


@contextlib.contextmanager
def ha_stack(run_dir: str | Path, *, schedulers: int = 2, workers: int = 2, attributions: int = 0,
             lease_ms: int = 1500, scheduler_args: Sequence[str] = (), timeout: float = 240.0,
             model_dir: str | Path = TINY_MODEL) -> Iterator[Stack]:
    stack = Stack(stack_args(run_dir, workers=workers, timeout=timeout, model_dir=model_dir))
    try:
        stack.redis = EmbeddedRedis(data_dir=stack.run_dir / "redis", aof=True, appendfsync="always").start()
        names = ["steering", "gateway_http", "gateway_grpc"] + [f"scheduler{i}" for i in range(schedulers)] \
            + [f"worker{i}" for i in range(workers)] + [f"attribution{i}" for i in range(attributions)]
        stack.ports = {n: free_port() for n in names}
        stack.services = _services(str(Path(model_dir).resolve()), stack.ports, schedulers, workers, attributions,
                                   lease_ms, scheduler_args)
        stack.prepare_internal_token()   # on, as the launcher has it: a fresh token per stack
        stack.env = stack.service_env(CDE_REDIS_URL=stack.redis.url, REDIS_URL=stack.redis.url)
        for svc in stack.services:
            svc.log = stack.run_dir / f"{svc.name}.log"
            svc.proc = subprocess.Popen(svc.args, cwd=ROOT, env=stack.env, stdout=svc.log.open("wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
        stack.wait_healthy()
        yield stack
    except BaseException:
        print_log_tails(stack)
        raise
    finally:
        stack.stop()


def active_scheduler(stack: Stack) -> tuple[Service, int]:
    """The scheduler process holding the lease, and its fencing token."""
    value = redis.Redis.from_url(stack.redis.url).get("cde:leader")
    assert value, "no scheduler holds the lease"
    token, instance, _ = value.decode().split("|")
    return next(s for s in stack.services if s.name == f"scheduler{instance[1:]}"), int(token)
