"""A small, offline renderer for the subset of kustomize that docker/k8s/ uses, so the test suite can
render the overlays without a kustomize binary (none ships on PyPI or in Debian's current release).

Supported: `resources` (manifest files and directories holding a kustomization.yaml), `patches` given
by `path` as strategic-merge patches of a resource of the same kind and name, `labels` (metadata labels
only; selectors and templates only when asked), `namespace`. Anything else in a kustomization raises
UnsupportedKustomization rather than being ignored, so a new feature in the manifests cannot pass the
tests by being silently dropped. Strategic merge follows Kubernetes' patch strategies for the fields
these manifests touch: maps merge, `null` deletes a key, the lists in LIST_MERGE_KEYS merge item by
item on their key, every other list is replaced.

tests/docker/test_k8s.py checks this renderer's output against `kubectl kustomize` where kubectl is
installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "labels", "namespace"}

# (list field name, merge key) for the Kubernetes lists whose patch strategy is "merge". Container
# ports merge on containerPort, Service ports on port: both are `ports`, told apart by their items.
LIST_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ports": ("containerPort", "port"),
}


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def load_documents(path: Path) -> list[Manifest]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def resource_id(manifest: Manifest) -> tuple[str, str, str]:
    group = manifest["apiVersion"].rpartition("/")[0]
    return (group, manifest["kind"], manifest["metadata"]["name"])


def _merge_key(field: str, items: list[Any]) -> str | None:
    for key in LIST_MERGE_KEYS.get(field, ()):
        if items and all(isinstance(item, dict) and key in item for item in items):
            return key
    return None


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """Merge `patch` into a copy of `target` the way `kubectl patch --type strategic` does for the
    fields listed above; returns the merged value."""
    if isinstance(patch, dict) and isinstance(target, dict):
        if "$patch" in patch or any(str(key).startswith("$") for key in patch):
            raise UnsupportedKustomization(f"patch directive in {field or 'patch'}: {sorted(patch)}")
        merged = copy.deepcopy(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(target, list):
        key = _merge_key(field, target + patch)
        if key is None:
            return copy.deepcopy(patch)
        merged_list = copy.deepcopy(target)
        positions = {item[key]: index for index, item in enumerate(merged_list)}
        for item in patch:
            if item[key] in positions:
                index = positions[item[key]]
                merged_list[index] = strategic_merge(merged_list[index], item, field)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def _add_labels(manifest: Manifest, pairs: dict[str, str], selectors: bool, templates: bool) -> None:
    manifest.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    spec = manifest.get("spec", {})
    if templates and isinstance(spec.get("template"), dict):
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    if selectors:
        selector = spec.get("selector")
        if manifest["kind"] == "Service" and isinstance(selector, dict):
            selector.update(pairs)
        elif isinstance(selector, dict):
            selector.setdefault("matchLabels", {}).update(pairs)


def render(directory: Path) -> list[Manifest]:
    """Build the kustomization in `directory` into its list of manifests."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{directory}/kustomization.yaml: {sorted(unknown)}")
    manifests: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        manifests.extend(render(path) if path.is_dir() else load_documents(path))
    by_id = {resource_id(manifest): index for index, manifest in enumerate(manifests)}
    if len(by_id) != len(manifests):
        raise ValueError(f"{directory}: two resources share a kind and name")
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: only `path` patches, got {sorted(patch_entry)}")
        for patch in load_documents(directory / patch_entry["path"]):
            patched_id = resource_id(patch)
            if patched_id not in by_id:
                raise ValueError(f"{directory}/{patch_entry['path']}: no resource {patched_id} to patch")
            index = by_id[patched_id]
            manifests[index] = strategic_merge(manifests[index], patch)
    for label_entry in kustomization.get("labels", []):
        unknown_options = set(label_entry) - {"pairs", "includeSelectors", "includeTemplates"}
        if unknown_options:
            raise UnsupportedKustomization(f"{directory}: labels options {sorted(unknown_options)}")
        # kustomize labels pod templates whenever it labels selectors, so the two keep matching.
        selectors = bool(label_entry.get("includeSelectors", False))
        templates = selectors or bool(label_entry.get("includeTemplates", False))
        for manifest in manifests:
            _add_labels(manifest, label_entry["pairs"], selectors=selectors, templates=templates)
    if "namespace" in kustomization:
        for manifest in manifests:
            manifest["metadata"]["namespace"] = kustomization["namespace"]
    return manifests
