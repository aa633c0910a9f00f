"""compose.yaml's structure (no Docker engine runs here): services, health checks through the
gRPC health service, GPU reservation, persistence, and that only the gateway publishes ports."""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"redis", "steering", "attribution", "scheduler", "worker-0", "gateway"}


def load():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_and_images():
    compose = load()
    assert EXPECTED <= set(compose["services"])
    for name in EXPECTED - {"redis"}:
        svc = compose["services"][name]
        assert svc.get("build") == "." and svc["command"][:3] == ["python", "-m", svc["command"][2]]
    assert (ROOT / "Dockerfile").exists()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for pkg in ("cde", "gateway", "scheduler_svc", "worker_svc", "steering_svc", "attribution_svc"):
        assert f"COPY {pkg} " in dockerfile


def test_health_checks_use_grpc_health():
    services = load()["services"]
    assert services["redis"]["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]
    for name in EXPECTED - {"redis"}:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "cde.healthcheck"], name
        port = test[4].rsplit(":", 1)[1]
        assert port in " ".join(services[name]["command"]), f"{name} checks a port it does not serve"


def test_only_the_gateway_publishes_ports_and_internal_network_is_internal():
    compose = load()
    published = {n for n, s in compose["services"].items() if s.get("ports")}
    assert published == {"gateway"}
    assert compose["networks"]["internal"]["internal"] is True
    for name, svc in compose["services"].items():
        nets = svc.get("networks", [])
        assert "internal" in nets, name
        assert ("public" in nets) == (name == "gateway"), name


def test_gpu_reservation_persistence_replicas_and_keys():
    services = load()["services"]
    devices = services["worker-0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert "--device" in services["worker-0"]["command"] and "cuda" in services["worker-0"]["command"]
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    assert any(v.startswith("redis-data:") for v in services["redis"]["volumes"])
    assert services["attribution"]["deploy"]["replicas"] >= 2
    assert "--api-keys-file" in services["gateway"]["command"]
    assert any(v.endswith(":ro") and v.startswith("models:") for v in services["worker-0"]["volumes"])
    assert services["scheduler"]["depends_on"]["redis"]["condition"] == "service_healthy"


# ---------------------------------------------------------------- compose.ha.yaml (HA override)
# `docker compose -f compose.yaml -f compose.ha.yaml up`: the tests below read the merged project.

HA_SERVICES = {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3", "scheduler-b"}
REPLACED = {"command", "entrypoint", "test"}   # sequences a later file replaces whole (healthcheck.test too)
HEREDOC = re.compile(r"\[ -f (\S+) \] \|\| cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", re.S)


def merge(base, over, key=None):
    """Compose's merge of a later -f file into an earlier one: mappings merge key by key,
    `command`/`entrypoint`/healthcheck `test` are replaced whole, other sequences (ports,
    volumes, networks, ...) keep the earlier items and add the new ones, scalars are replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base[k], v, k) if k in base else v for k, v in over.items()}}
    if isinstance(base, list) and isinstance(over, list) and key not in REPLACED:
        return base + [v for v in over if v not in base]
    return over


def load_ha():
    return merge(load(), yaml.safe_load((ROOT / "compose.ha.yaml").read_text()))


def flag(cmd, name):
    """The value after ``name`` in a command list; None when the flag is absent."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


def module(svc) -> str | None:
    """The python module a cde service runs (``python -m MODULE``)."""
    cmd = svc.get("command") or []
    return cmd[2] if cmd[:2] == ["python", "-m"] else None


def sentinel_parts(svc):
    """(config path, config text, exec argv) of a sentinel's `sh -ec` command, which writes the
    config with a quoted heredoc when absent and execs redis-server on it."""
    cmd = svc["command"]
    assert cmd[:2] == ["sh", "-ec"] and len(cmd) == 3, f"not an `sh -ec SCRIPT` command: {cmd}"
    script = cmd[2]
    m = HEREDOC.search(script)
    assert m, f"no `[ -f CONF ] || cat > CONF <<'EOF' ... EOF` in:\n{script}"
    assert m.group(1) == m.group(2), f"checks {m.group(1)} but writes {m.group(2)}"
    exec_lines = [line for line in script.splitlines() if line.startswith("exec ")]
    assert len(exec_lines) == 1, f"expected one exec line, got {exec_lines}"
    argv = shlex.split(exec_lines[0].replace("$$", "$"))[1:]   # compose turns $$ into $
    return m.group(1), m.group(3), argv


def sentinel_conf(text) -> dict[str, list[str]]:
    """A sentinel config's directives, ``"sentinel monitor"`` -> its words (one per directive)."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if words:
            key = " ".join(words[:2]) if words[0] == "sentinel" else words[0]
            out[key] = words[2:] if words[0] == "sentinel" else words[1:]
    return out


def sentinels(services) -> list[str]:
    return sorted(n for n, s in services.items() if s.get("image", "").startswith("redis")
                  and "--sentinel" in " ".join(s.get("command") or []))


def sentinel_port(svc) -> int:
    return int(sentinel_conf(sentinel_parts(svc)[1])["port"][0])


def redis_port(svc) -> int:
    return int(flag(svc["command"], "--port") or 6379)


def test_merge_follows_compose_rules():
    """The tests below are only as good as this merge."""
    base = {"command": ["a", "b"], "ports": ["1:1"], "depends_on": {"x": {"condition": "c"}},
            "healthcheck": {"test": ["CMD", "a"], "interval": "5s"}, "image": "i"}
    over = {"command": ["c"], "ports": ["2:2"], "depends_on": {"y": {"condition": "d"}},
            "healthcheck": {"test": ["CMD", "b"]}, "image": "j"}
    got = merge(base, over)
    assert got == {"command": ["c"], "ports": ["1:1", "2:2"],
                   "depends_on": {"x": {"condition": "c"}, "y": {"condition": "d"}},
                   "healthcheck": {"test": ["CMD", "b"], "interval": "5s"}, "image": "j"}, got


def test_ha_services_exist_on_the_internal_network_only():
    """Sentinels, the replica and the standby scheduler are for cde's services only."""
    compose = load_ha()
    services = compose["services"]
    assert HA_SERVICES <= set(services), f"missing: {HA_SERVICES - set(services)}"
    assert EXPECTED <= set(services), f"missing: {EXPECTED - set(services)}"
    assert compose["networks"]["internal"]["internal"] is True, compose["networks"]
    for name in HA_SERVICES:
        assert services[name].get("networks") == ["internal"], (name, services[name].get("networks"))
    assert sentinels(services) == ["sentinel-1", "sentinel-2", "sentinel-3"], sentinels(services)


def test_ha_only_the_gateway_publishes_ports():
    services = load_ha()["services"]
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert set(published) == {"gateway"}, published
    for name, svc in services.items():
        assert ("public" in svc.get("networks", [])) == (name == "gateway"), (name, svc.get("networks"))


def test_ha_schedulers_use_the_sentinels_wait_for_a_replica_and_differ_in_id():
    """Parsed by the scheduler's own CLI, so a misspelt flag fails here, not at `up`."""
    from cde.redis_connect import RedisTarget
    from scheduler_svc.__main__ import parse_args

    services = load_ha()["services"]
    schedulers = sorted(n for n, s in services.items() if module(s) == "scheduler_svc")
    assert schedulers == ["scheduler", "scheduler-b"], schedulers
    base_cmd = load()["services"]["scheduler"]["command"]
    ids = {}
    for name in schedulers:
        svc = services[name]
        args = parse_args(svc["command"][3:])   # the scheduler's own CLI: unknown flags fail here
        target = RedisTarget.from_args(args)
        assert target.sentinels, f"{name}: no --redis-sentinels in {svc['command']}"
        for host, port in target.sentinels:
            assert host in sentinels(services), f"{name}: {host}:{port} is not a sentinel service"
            assert port == sentinel_port(services[host]), \
                f"{name}: {host}:{port}, but {host} listens on {sentinel_port(services[host])}"
        assert len(target.sentinels) == len(sentinels(services)), (name, target.sentinels)
        for s in sentinels(services):
            monitor = sentinel_conf(sentinel_parts(services[s])[1])["sentinel monitor"]
            assert target.master == monitor[0], f"{name} asks for {target.master!r}, {s} monitors {monitor}"
        assert target.wait_replicas == 1, (name, target.wait_replicas)
        assert args.lease_ms > 0, (name, args.lease_ms)
        assert args.advertise == f"{name}:{args.port}", (name, args.advertise, args.port)
        assert args.host == "0.0.0.0", (name, args.host)
        for kept in ("--attribution", "--detach-grace"):
            assert flag(svc["command"], kept) == flag(base_cmd, kept), (name, kept, svc["command"])
        assert "--redis-url" not in svc["command"], f"{name}: with sentinels the URL's host is ignored"
        deps = svc.get("depends_on", {})
        for s in sentinels(services) + ["redis-replica"]:
            assert deps.get(s, {}).get("condition") == "service_healthy", (name, s, deps)
        ids[name] = args.scheduler_id
    assert len(set(ids.values())) == len(ids) and all(ids.values()), f"scheduler ids not distinct: {ids}"


def test_ha_scheduler_b_is_the_scheduler_again():
    """scheduler-b spells out compose.yaml's x-service (anchors stay in their file): no drift."""
    services = load_ha()["services"]
    a, b = services["scheduler"], services["scheduler-b"]
    for key in ("build", "image", "restart", "networks", "environment", "secrets", "volumes", "healthcheck"):
        assert a.get(key) == b.get(key), f"{key}: scheduler {a.get(key)!r} != scheduler-b {b.get(key)!r}"
    differ = {"--scheduler-id", "--advertise"}

    def rest(cmd):
        return [w for i, w in enumerate(cmd) if w not in differ and (i == 0 or cmd[i - 1] not in differ)]
    assert rest(a["command"]) == rest(b["command"]), (a["command"], b["command"])


def test_ha_workers_and_gateway_list_both_schedulers():
    """A client that names one scheduler is stuck when that one stands by."""
    services = load_ha()["services"]
    base = load()["services"]
    schedulers = {n: s for n, s in services.items() if module(s) == "scheduler_svc"}
    clients = sorted(n for n, s in services.items() if s.get("command") and "--scheduler" in s["command"])
    workers = [n for n, s in services.items() if module(s) == "worker_svc"]
    assert workers and set(workers) | {"gateway"} == set(clients), (workers, clients)
    for name in clients:
        cmd = services[name]["command"]
        listed = [a.strip() for a in flag(cmd, "--scheduler").split(",")]
        hosts = [a.rsplit(":", 1)[0] for a in listed]
        assert sorted(hosts) == sorted(schedulers), f"{name}: --scheduler {listed}, schedulers {sorted(schedulers)}"
        for addr in listed:
            host, port = addr.rsplit(":", 1)
            served = flag(schedulers[host]["command"], "--port")
            assert port == served, f"{name}: {addr}, but {host} serves --port {served}"
        if name in base:   # the rest as in compose.yaml
            before = base[name]["command"]
            i = cmd.index("--scheduler")
            assert cmd[:i + 1] + cmd[i + 2:] == before[:i + 1] + before[i + 2:], (name, before, cmd)


def test_ha_sentinels_monitor_the_master_with_a_quorum():
    """By hostname (container IPs change), with a quorum the sentinels can reach."""
    services = load_ha()["services"]
    names = sentinels(services)
    scripts = {n: services[n]["command"] for n in names}
    assert len({tuple(c) for c in scripts.values()}) == 1, f"sentinel commands differ: {scripts}"
    for name in names:
        svc = services[name]
        path, text, argv = sentinel_parts(svc)
        conf = sentinel_conf(text)
        monitor = conf["sentinel monitor"]
        master, host, port, quorum = monitor[0], monitor[1], int(monitor[2]), int(monitor[3])
        assert host == "redis" and port == redis_port(services["redis"]), f"{name} monitors {monitor}"
        assert 2 <= quorum <= len(names), f"{name}: quorum {quorum} with {len(names)} sentinels"
        assert conf["sentinel down-after-milliseconds"] == [master, "5000"], conf
        assert conf["sentinel failover-timeout"] == [master, "60000"], conf
        for key in ("sentinel resolve-hostnames", "sentinel announce-hostnames"):
            assert conf.get(key) == ["yes"], (name, key, conf.get(key))
        lines = [line.split()[:2] for line in text.splitlines()]
        assert lines.index(["sentinel", "resolve-hostnames"]) < lines.index(["sentinel", "monitor"]), \
            f"{name}: resolve-hostnames must come before a monitor that names a host:\n{text}"
        assert conf["dir"] == [path.rsplit("/", 1)[0]], (name, conf["dir"], path)   # sentinel rewrites it there
        assert argv[argv.index("redis-server") + 1:argv.index("redis-server") + 3] == [path, "--sentinel"], argv
        assert argv[-3:] == ["--sentinel", "announce-ip", "${SENTINEL_HOST}"], argv
        assert svc["environment"]["SENTINEL_HOST"] == name, (name, svc["environment"])


def test_ha_replica_replicates_the_master_on_its_own_volume():
    """Two data nodes sharing a volume would share one AOF."""
    compose = load_ha()
    services = compose["services"]
    master, replica = services["redis"], services["redis-replica"]
    assert replica["image"] == master["image"] == "redis:7.4", (master["image"], replica["image"])
    assert "--replicaof" not in master["command"], master["command"]
    i = replica["command"].index("--replicaof")
    assert replica["command"][i + 1:i + 3] == ["redis", str(redis_port(master))], replica["command"]
    for name, svc in (("redis", master), ("redis-replica", replica)):
        assert flag(svc["command"], "--appendonly") == "yes", (name, svc["command"])
        assert flag(svc["command"], "--replica-announce-ip") == name, (name, svc["command"])
    vols = {v.split(":")[0] for v in replica["volumes"]}
    assert vols and not vols & {v.split(":")[0] for v in master["volumes"]}, (master["volumes"], replica["volumes"])
    assert vols <= set(compose["volumes"]), (vols, compose["volumes"])


def test_ha_health_checks_for_every_ha_service():
    """depends_on service_healthy waits on these, and each checks the port its service serves."""
    services = load_ha()["services"]
    for name in sorted(HA_SERVICES | {"redis"}):
        test = services[name].get("healthcheck", {}).get("test")
        assert test, f"{name}: no healthcheck"
        if name in sentinels(services):
            assert test == ["CMD", "redis-cli", "-p", str(sentinel_port(services[name])), "ping"], (name, test)
        elif services[name]["image"].startswith("redis"):
            assert test == ["CMD", "redis-cli", "ping"], (name, test)
        else:
            assert test[:4] == ["CMD", "python", "-m", "cde.healthcheck"], (name, test)
            assert test[4].rsplit(":", 1)[1] == flag(services[name]["command"], "--port"), (name, test)


def test_ha_sentinel_config_runs(tmp_path):
    """The commands compose.ha.yaml gives the data nodes and the sentinels, run as real
    redis-server processes on loopback (compose names -> 127.0.0.1, compose ports -> free ports):
    the three sentinels agree on the master and find the replica and each other."""
    from cde.redis_util import LOOPBACK, EmbeddedRedis, free_ports, redis_server_binary

    services = load_ha()["services"]
    names = sentinels(services)
    compose_port = {"redis": redis_port(services["redis"]), "redis-replica": redis_port(services["redis-replica"]),
                    **{n: sentinel_port(services[n]) for n in names}}
    port = dict(zip(compose_port, free_ports(len(compose_port))))

    def local(words):
        """Service names -> loopback; a service's compose port right after its name -> its local port."""
        out, i = [], 0
        while i < len(words):
            w = words[i]
            if w in port:
                out.append(LOOPBACK)
                if i + 1 < len(words) and words[i + 1] == str(compose_port[w]):
                    out.append(str(port[w]))
                    i += 1
            else:
                out.append(w)
            i += 1
        return out

    nodes, procs = [], []
    try:
        for name in ("redis", "redis-replica"):
            cmd = services[name]["command"]
            assert cmd[0] == "redis-server", (name, cmd)
            nodes.append(EmbeddedRedis(port=port[name], data_dir=tmp_path / name, extra_args=local(cmd[1:])).start())
        for name in names:
            path, text, argv = sentinel_parts(services[name])
            d = tmp_path / name
            d.mkdir()
            lines = []
            for line in text.splitlines():
                words = line.split()
                if words[:1] == ["port"]:
                    words = ["port", str(port[name])]
                elif words[:1] == ["dir"]:
                    words = ["dir", str(d)]
                lines.append(" ".join(local(words)))
            conf = d / "sentinel.conf"
            conf.write_text("\n".join(lines + [f"bind {LOOPBACK}"]) + "\n")
            env = services[name].get("environment", {})
            argv = [str(conf) if w == path else redis_server_binary() if w == "redis-server"
                    else env.get(w[2:-1], w) if w.startswith("${") else w
                    for w in argv if w != "docker-entrypoint.sh"]
            with (d / "sentinel.log").open("wb") as log:
                procs.append(subprocess.Popen(local(argv), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, cwd=d, start_new_session=True))

        want = (LOOPBACK, port["redis"])
        master = sentinel_conf(sentinel_parts(services[names[0]])[1])["sentinel monitor"][0]
        state, deadline = {}, time.monotonic() + 20

        def seen():
            for name in names:
                try:
                    r = redis.Redis(host=LOOPBACK, port=port[name], socket_timeout=1, decode_responses=True)
                    addr = r.sentinel_get_master_addr_by_name(master)
                    state[name] = {"master": (addr[0], int(addr[1])) if addr else None,
                                   "replicas": sorted((s["ip"], int(s["port"]), s["flags"])
                                                      for s in r.sentinel_slaves(master)),
                                   "sentinels": len(r.sentinel_sentinels(master))}
                except redis.RedisError as e:
                    state[name] = repr(e)
            return all(isinstance(s, dict) and s["master"] == want and s["sentinels"] == len(names) - 1
                       and any(p == port["redis-replica"] and f == "slave" for _, p, f in s["replicas"])
                       for s in state.values())

        while not seen() and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = {n: (tmp_path / n / "sentinel.log").read_text()[-1500:] for n in names}
        assert seen(), (f"after 20 s the sentinels see {state}; wanted master {want}, replica port "
                        f"{port['redis-replica']}, {len(names) - 1} other sentinels each; logs: {logs}")
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=5)
        for node in reversed(nodes):
            node.stop()


def test_one_worker_per_gpu_with_the_gpu2_profile():
    """worker-0 on GPU 0 always; worker-1 (profile gpu2) on GPU 1, its own id and address."""
    services = load()["services"]
    workers = {n: s for n, s in services.items() if module(s) == "worker_svc"}
    assert set(workers) == {"worker-0", "worker-1"}
    assert "profiles" not in workers["worker-0"] and workers["worker-1"]["profiles"] == ["gpu2"]
    for i, (name, s) in enumerate(sorted(workers.items())):
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert [d["device_ids"] for d in devices] == [[str(i)]], name
        assert flag(s["command"], "--worker-id") == name and flag(s["command"], "--advertise") == f"{name}:50081"
