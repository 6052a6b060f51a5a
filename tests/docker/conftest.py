from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docker.kustomize_subset import Manifest, render

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
OVERLAYS = ("gpu", "cpu")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def one(manifests: list[Manifest], kind: str) -> Manifest:
    found = [manifest for manifest in manifests if manifest["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="session", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Manifest]]:
    """(overlay name, its rendered manifests)."""
    return request.param, render(K8S / "overlays" / request.param)


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_yaml(DOCKER / "compose.yaml")
