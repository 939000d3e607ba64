"""deploy/kubernetes describes the services correctly: every manifest is valid against
Kubernetes' own schemas (kubernetes-validate ships them; nothing is fetched), kustomization
lists every file, each secret is mounted only by the pod that needs it, the worker holds the
node's GPUs, and every OPENTINKER_* variable names a field of the service's settings."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.33.0"  # the oldest release still supported upstream when this was written
pytestmark = pytest.mark.unit


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def test_every_manifest_is_valid_and_listed_in_the_kustomization() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    files = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    for doc in manifests().values():
        kubernetes_validate.validate(doc, VERSION, strict=True)
    broken = copy.deepcopy(manifests()[("DaemonSet", "worker")])
    pod_spec(broken)["containers"][0]["imagePullPolicyy"] = "Always"  # a typo is caught
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_services_and_their_probes() -> None:
    found = manifests()
    for name in ("scheduler", "envhub", "tinker-gateway", "dashboard"):
        assert ("Service", name) in found, name
        container = pod_spec(found[("Deployment", name)])["containers"][0]
        assert container["args"] == ["serve", name]
        for probe in ("readinessProbe", "livenessProbe"):
            assert "grpc" in container[probe] or "httpGet" in container[probe], (name, probe)
    scheduler = found[("Deployment", "scheduler")]
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"]["type"] == "Recreate"  # never two schedulers at once
    redis = found[("StatefulSet", "redis")]
    args = pod_spec(redis)["containers"][0]["args"]
    assert args[args.index("--appendfsync") + 1] == "always"
    assert redis["spec"]["volumeClaimTemplates"], "Redis keeps its data on a volume"


def test_the_worker_is_one_agent_per_gpu_node_named_by_its_node() -> None:
    worker = manifests()[("DaemonSet", "worker")]
    spec = pod_spec(worker)
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["OPENTINKER_WORKER_ID"]["value"] == "$(NODE_NAME)"
    token = env["OPENTINKER_WORKER_TOKEN_FILE"]["value"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert token == mounts["tokens"]["mountPath"] + "/$(NODE_NAME)"
    assert mounts["tokens"]["readOnly"]
    assert spec["terminationGracePeriodSeconds"] >= 45  # stops its jobs before it is killed


def test_each_secret_is_mounted_by_the_one_pod_that_needs_it() -> None:
    """Job processes run in the worker's pod: it must mount its token and nothing else."""
    wanted = {
        "opentinker-auth": "scheduler",
        "opentinker-gateway": "tinker-gateway",
        "opentinker-worker-tokens": "worker",
    }
    mounted: dict[str, list[str]] = {}
    for (_, name), doc in manifests().items():
        if "template" not in doc.get("spec", {}):
            continue
        for volume in pod_spec(doc).get("volumes", []):
            if "secret" in volume:
                mounted.setdefault(volume["secret"]["secretName"], []).append(name)
                assert volume["secret"]["defaultMode"] == 0o400, (name, volume)
    assert mounted == {secret: [pod] for secret, pod in wanted.items()}
    claims = [
        name
        for (_, name), doc in manifests().items()
        if "template" in doc.get("spec", {})
        for v in pod_spec(doc).get("volumes", [])
        if v.get("persistentVolumeClaim", {}).get("claimName") == "scheduler-identity"
    ]
    assert claims == ["scheduler"], "the admin key's volume is the scheduler's alone"


def test_every_setting_is_one_the_service_reads() -> None:
    from opentinker.services.dashboard.settings import DashboardSettings
    from opentinker.services.envhub.settings import EnvHubSettings
    from opentinker.services.gateway.settings import GatewaySettings
    from opentinker.services.scheduler.settings import SchedulerSettings
    from opentinker.services.worker.settings import WorkerSettings

    settings = {
        "scheduler": SchedulerSettings,
        "envhub": EnvHubSettings,
        "worker": WorkerSettings,
        "tinker-gateway": GatewaySettings,
        "dashboard": DashboardSettings,
    }
    for (kind, name), doc in manifests().items():
        if name not in settings or kind == "Service":
            continue
        cls = settings[name]
        prefix = cls.model_config["env_prefix"].upper()
        env = [e["name"] for e in pod_spec(doc)["containers"][0]["env"]]
        ours = [k for k in env if k.startswith(prefix)]
        assert ours, name
        for key in ours:
            field = key.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{name}: {key} is not a {cls.__name__} field"
