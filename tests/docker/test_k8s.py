"""docker/k8s: the overlays render, every manifest validates against the Kubernetes schemas offline,
and every metric, port, path and setting they name is one the service really has."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.settings import Settings, settings_from_argv
from tests.docker import service_contract as contract
from tests.docker.conftest import K8S, OVERLAYS, REPO, load_yaml, one
from tests.docker.kustomize_subset import Manifest, render, resource_id

# The oldest Kubernetes minor these manifests promise to work on, and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
EXPECTED_KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                  "ServiceMonitor"}
CRD_KINDS = {"ServiceMonitor"}

# The part of the Prometheus Operator's ServiceMonitor CRD these manifests use; a misspelt or misplaced
# field fails here as it would in the cluster's CRD validation.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object",
                                                   "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def container(manifests: list[Manifest]) -> dict[str, Any]:
    containers = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def config_data(manifests: list[Manifest]) -> dict[str, str]:
    return one(manifests, "ConfigMap")["data"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(
    overlay: tuple[str, list[Manifest]], version: str
) -> None:
    _, manifests = overlay
    assert {manifest["kind"] for manifest in manifests} == EXPECTED_KINDS
    for manifest in manifests:
        if manifest["kind"] in CRD_KINDS:
            jsonschema.validate(manifest, SERVICE_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(manifest, version, strict=True)


def test_schema_validation_catches_a_misplaced_field(overlay: tuple[str, list[Manifest]]) -> None:
    # Proves the strict schemas are in force: a probe field one level too high must be refused.
    broken = dict(one(overlay[1], "Deployment"))
    broken["spec"] = {**broken["spec"], "livenessProbe": {"httpGet": {"path": "/health", "port": 8000}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (holds kustomize) not installed")
@pytest.mark.parametrize("name", OVERLAYS)
def test_offline_renderer_agrees_with_kubectl_kustomize(name: str) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    theirs = {resource_id(doc): doc for doc in yaml.safe_load_all(built) if doc}
    ours = {resource_id(doc): doc for doc in render(K8S / "overlays" / name)}
    assert ours == theirs


def test_probes_ports_and_args_name_what_the_service_serves(overlay: tuple[str, list[Manifest]]) -> None:
    _, manifests = overlay
    served, port = contract.served_paths(), contract.default_port()
    main = container(manifests)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": port}
    args = main["args"]
    assert args[0] == "serve" and args[args.index("--port") + 1] == str(port)
    assert settings_from_argv(args[1:]).port == port  # the flags are ones `reformer serve` accepts
    probes = {name: main[name]["httpGet"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["startupProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for probe in probes.values():
        assert probe["path"] in served
        assert probe["port"] in ports
    service = one(manifests, "Service")
    for service_port in service["spec"]["ports"]:
        assert service_port["targetPort"] in ports
    monitor = one(manifests, "ServiceMonitor")
    service_port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_port_names
        assert endpoint["path"] == "/metrics" and endpoint["path"] in served


def test_selectors_pick_the_deployments_pods(overlay: tuple[str, list[Manifest]]) -> None:
    _, manifests = overlay
    deployment = one(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "Service": one(manifests, "Service")["spec"]["selector"],
        "PodDisruptionBudget": one(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector and selector.items() <= pod_labels.items(), kind
    service_labels = one(manifests, "Service")["metadata"]["labels"]
    monitor_selector = one(manifests, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert monitor_selector.items() <= service_labels.items()


def test_termination_grace_covers_prestop_and_drain(overlay: tuple[str, list[Manifest]]) -> None:
    _, manifests = overlay
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    prestop = container(manifests)["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    drain = float(config_data(manifests)["REFORMER_GRACE_PERIOD_S"])
    # The kubelet's SIGKILL must come after the preStop sleep and the whole drain, with time to exit.
    assert pod["terminationGracePeriodSeconds"] >= float(prestop[1]) + drain + 5


def test_configmap_and_secret_are_settings_the_service_accepts(
    overlay: tuple[str, list[Manifest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, manifests = overlay
    data = config_data(manifests)
    assert set(data) <= contract.settings_env_names()
    main = container(manifests)
    assert main["envFrom"] == [{"configMapRef": {"name": one(manifests, "ConfigMap")["metadata"]["name"]}}]
    secret_env = {env["name"]: env["valueFrom"]["secretKeyRef"] for env in main["env"]}
    assert set(secret_env) == {"REFORMER_API_KEY"} <= contract.settings_env_names()
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("REFORMER_API_KEY", "from-the-secret")
    settings = Settings()  # validates every value as the service will at start-up
    assert settings.device == {"gpu": "cuda", "cpu": "cpu"}[name]
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-the-secret"


def test_only_the_gpu_overlay_asks_for_a_gpu(overlay: tuple[str, list[Manifest]]) -> None:
    name, manifests = overlay
    resources = container(manifests)["resources"]
    gpus = {section: resources.get(section, {}).get("nvidia.com/gpu") for section in ("requests", "limits")}
    if name == "gpu":
        assert gpus == {"requests": "1", "limits": "1"}
        assert one(manifests, "Deployment")["spec"]["template"]["spec"]["tolerations"]
    else:
        assert gpus == {"requests": None, "limits": None}
    # The HPA's CPU fallback needs a CPU request to compute utilisation against.
    assert "cpu" in resources["requests"]


def test_hpa_scales_on_the_adapters_queue_metric_with_cpu_fallback(
    overlay: tuple[str, list[Manifest]],
) -> None:
    _, manifests = overlay
    hpa = one(manifests, "HorizontalPodAutoscaler")["spec"]
    deployment = one(manifests, "Deployment")
    assert hpa["scaleTargetRef"] == {"apiVersion": deployment["apiVersion"], "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    by_type = {metric["type"]: metric for metric in hpa["metrics"]}
    assert set(by_type) == {"Pods", "Resource"}
    assert by_type["Resource"]["resource"]["name"] == "cpu"
    hpa_metric = by_type["Pods"]["pods"]["metric"]["name"]

    adapter_rules = load_yaml(K8S / "prometheus-adapter" / "values.yaml")["rules"]["custom"]
    served_by_adapter = {rule["name"]["as"]: rule for rule in adapter_rules}
    assert hpa_metric in served_by_adapter
    rule = served_by_adapter[hpa_metric]
    for text in (rule["seriesQuery"], rule["metricsQuery"], rule["name"]["matches"], rule["name"]["as"]):
        assert contract.unknown_metrics(text) == set()
    assert contract.metric_names_in(rule["seriesQuery"]) == {"reformer_queue_size"}
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # The PDB must leave pods standing at the HPA's minimum.
    assert one(manifests, "PodDisruptionBudget")["spec"]["maxUnavailable"] < hpa["minReplicas"]


def test_renderer_merges_like_a_strategic_merge_patch(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "kustomization.yaml").write_text("resources: [deploy.yaml]\n")
    (base / "deploy.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"template": {"spec": {
            "tolerations": [{"key": "a"}],
            "containers": [{"name": "main", "image": "x", "env": [{"name": "A", "value": "1"}]},
                           {"name": "side", "image": "y"}]}}}}))
    (tmp_path / "kustomization.yaml").write_text("resources: [base]\npatches: [{path: patch.yaml}]\n")
    (tmp_path / "patch.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
        "spec": {"template": {"spec": {
            "tolerations": [{"key": "b"}],
            "containers": [{"name": "main", "image": None, "env": [{"name": "B", "value": "2"}]}]}}}}))
    (rendered,) = render(tmp_path)
    pod = rendered["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "b"}]  # no merge key: replaced
    assert pod["containers"] == [
        {"name": "main", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},  # null deletes
        {"name": "side", "image": "y"},
    ]
    (tmp_path / "kustomization.yaml").write_text("resources: [base]\nconfigMapGenerator: []\n")
    with pytest.raises(ValueError, match="configMapGenerator"):
        render(tmp_path)


def test_deploy_doc_states_the_kustomize_version_the_overlays_need() -> None:
    # `labels:` and `patches: - path:` arrived in kustomize 4.1, which kubectl embeds from 1.22.
    uses = "".join(path.read_text() for path in K8S.rglob("kustomization.yaml"))
    deploy = (REPO / "docs/DEPLOY.md").read_text()
    if "labels:" in uses or "- path:" in uses:
        assert "kustomize >= 4.1" in deploy and "kubectl >= 1.22" in deploy


def test_the_root_file_system_is_read_only_with_a_writable_tmp(overlay: tuple[str, list[Manifest]]) -> None:
    # bench/docker/image_check.py runs the image with `docker run --read-only --tmpfs /tmp`: the same here
    _, manifests = overlay
    main = container(manifests)
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in one(manifests, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]]
