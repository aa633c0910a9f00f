"""compose.yaml's structure (no Docker engine runs here): services, health checks through the
gRPC health service, GPU reservation, persistence, and that only the gateway publishes ports."""

from __future__ import annotations

from pathlib import Path

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
