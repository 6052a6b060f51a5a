"""docker/k8s/prefix-cache: the shared-volume variant renders and validates, and mounts its ReadWriteMany claim
where REFORMER_PREFIX_CACHE_DIR points; the ingress-nginx and Envoy Gateway affinity manifests validate where
Kubernetes has the schema, route to the Service the overlays make, and hash on the same header."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from service.settings import Settings
from tests.docker.conftest import K8S, REPO, load_yaml, one
from tests.docker.kustomize_subset import load_documents, render
from tests.docker.test_k8s import KUBERNETES_VERSIONS

PREFIX_CACHE = K8S / "prefix-cache"
HEADER = "X-Document-Id"


def _service() -> dict[str, Any]:
    service: dict[str, Any] = load_yaml(K8S / "base" / "service.yaml")
    return service


def _storage_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_shared_volume_variant_validates_and_mounts_the_claim_where_the_cache_dir_points(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = render(PREFIX_CACHE / "shared-volume")
    for manifest in manifests:
        if manifest["kind"] != "ServiceMonitor":  # a CRD: tests/docker/test_k8s.py checks its schema
            kubernetes_validate.validate(manifest, version, strict=True)
    claim = one(manifests, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica mounts it at once
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    (name,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert volumes[name]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    data = one(manifests, "ConfigMap")["data"]
    assert mounts[name] == data["REFORMER_PREFIX_CACHE_DIR"]
    assert mounts["tmp"] == "/tmp"  # the base's mounts kept
    # the HMAC key: a Secret (not optional: replicas without a shared key cannot read each other's files),
    # mounted read-only where REFORMER_PREFIX_CACHE_KEY_FILE points, readable by the pod's group only
    secret = volumes["prefix-cache-key"]["secret"]
    assert secret["secretName"] == "reformer-prefix-cache-key" and not secret.get("optional", False)
    assert secret["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
    (item,) = secret["items"]
    assert data["REFORMER_PREFIX_CACHE_KEY_FILE"] == f"{mounts['prefix-cache-key']}/{item['path']}"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "prefix-cache-key")
    assert mount["readOnly"]
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert str(settings.prefix_cache_dir) == data["REFORMER_PREFIX_CACHE_DIR"] and settings.prefix_cache
    # the folder's cap sits below the claim, so trimming runs before the volume fills
    assert settings.prefix_cache_dir_bytes < _storage_bytes(claim["spec"]["resources"]["requests"]["storage"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_ingress_nginx_hashes_on_the_session_header_to_the_service(version: str) -> None:
    (ingress,) = load_documents(PREFIX_CACHE / "ingress-nginx.yaml")
    kubernetes_validate.validate(ingress, version, strict=True)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_" + HEADER.lower().replace("-", "_")
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    backend = path["backend"]["service"]
    service = _service()
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert annotations["nginx.ingress.kubernetes.io/proxy-body-size"] == "4m"
    assert Settings().max_payload_bytes <= 4 * 2**20  # the service refuses an oversized body first, with a 413


def test_envoy_gateway_route_and_policy_hash_on_the_same_header_to_the_service() -> None:
    docs = load_documents(PREFIX_CACHE / "envoy-gateway.yaml")
    route, policy = one(docs, "HTTPRoute"), one(docs, "BackendTrafficPolicy")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    service = _service()
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    balancer = policy["spec"]["loadBalancer"]
    assert balancer["type"] == "ConsistentHash"
    assert balancer["consistentHash"] == {"type": "Header", "header": {"name": HEADER}}


def test_deploy_doc_names_every_prefix_cache_manifest() -> None:
    deploy = (REPO / "docs/DEPLOY.md").read_text()
    section = deploy[deploy.index("## Prefix cache across replicas"):]
    for path in ("docker/k8s/prefix-cache/ingress-nginx.yaml", "docker/k8s/prefix-cache/envoy-gateway.yaml",
                 "docker/k8s/prefix-cache/shared-volume"):
        assert path in section
