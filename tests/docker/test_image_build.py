"""How the image is built, read off the Dockerfile and .dockerignore: the dependencies install before the
source is copied (a source change rebuilds only the package), the runtime stage copies them as two layers and
has no compiler, the CA reaches pip and apt only as a BuildKit secret, an offline build reads the wheelhouse
stage, and the image carries OCI labels. bench/docker/image_check.py builds it and checks the same on the
image itself (build times, its layers and history)."""

from __future__ import annotations

import re

import tomllib

from tests.docker.conftest import REPO
from tests.docker.test_dockerfile import DOCKERFILE, in_build_context, last, parse_stages, stage_named

TEXT = DOCKERFILE.read_text()
STAGES = parse_stages(TEXT)
BUILD = stage_named(STAGES, "build")
FINAL = STAGES[-1]
SECRET_MOUNT = "--mount=type=secret,id=ca"


def test_dependencies_install_before_the_source_is_copied() -> None:
    steps = [(i.keyword, i.argument) for i in BUILD if i.keyword in ("COPY", "RUN")]
    deps = next(n for n, (_, arg) in enumerate(steps) if arg.endswith("docker/install.sh deps /opt/venv /src"))
    package = next(n for n, (_, arg) in enumerate(steps) if arg.endswith("docker/install.sh package /opt/venv /src"))
    copied_before = {arg for keyword, arg in steps[:deps] if keyword == "COPY"}
    # the dependency layer's inputs: pyproject.toml (the dependency list) and the install script, nothing else
    assert copied_before == {"pyproject.toml ./", "docker/install.sh ./docker/install.sh"}
    sources = [arg for keyword, arg in steps[deps:package] if keyword == "COPY"]
    assert any(arg.startswith("service ") for arg in sources) and any(arg.startswith("model ") for arg in sources)


def test_the_runtime_stage_copies_dependencies_and_package_as_two_layers_without_a_compiler() -> None:
    copies = [i.argument for i in FINAL if i.keyword == "COPY" and i.argument.startswith("--from=build")]
    assert copies == ["--from=build /opt/venv /opt/venv", "--from=build /opt/reformer/site /opt/reformer/site"]
    runs = " ".join(i.argument for i in FINAL if i.keyword == "RUN")
    assert not re.search(r"\b(gcc|g\+\+|clang|build-essential|libc6-dev)\b", runs)
    assert "rm -rf /var/lib/apt/lists/*" in runs
    env = " ".join(i.argument for i in BUILD if i.keyword == "ENV")
    assert "PIP_NO_CACHE_DIR=1" in env  # no pip cache in the venv the runtime stage copies


def test_the_ca_reaches_pip_and_apt_only_as_a_build_secret() -> None:
    for stage in (BUILD, FINAL):
        for instruction in stage:
            if instruction.keyword == "RUN" and re.search(r"apt-get|install\.sh", instruction.argument):
                assert SECRET_MOUNT in instruction.argument, instruction.argument
            # nothing copies, adds or sets a certificate: a layer or the image's config would keep it
            if instruction.keyword in ("COPY", "ADD", "ENV", "ARG"):
                assert not re.search(r"\.crt|\.pem|secrets|CERT|CA_BUNDLE", instruction.argument), instruction.argument
    install = (REPO / "docker/install.sh").read_text()
    assert 'CA_BUNDLE=${CA_BUNDLE:-/run/secrets/ca}' in install and "export PIP_CERT=$CA_BUNDLE" in install
    assert "Acquire::https::CAInfo=/run/secrets/ca" in (REPO / "docker/apt-ca.sh").read_text()
    assert all("apt-ca apt-get" in i.argument for stage in (BUILD, FINAL) for i in stage
               if i.keyword == "RUN" and "apt-get" in i.argument)


def test_an_offline_build_reads_the_wheelhouse_stage() -> None:
    wheelhouse = stage_named(STAGES, "wheelhouse")
    assert [i.argument for i in wheelhouse if i.keyword == "COPY"] == ["wheelhouse/ /"]
    installs = [i.argument for i in BUILD if i.keyword == "RUN" and "install.sh" in i.argument]
    assert all("--mount=type=bind,from=wheelhouse,target=/wheelhouse" in run for run in installs)
    install = (REPO / "docker/install.sh").read_text()
    assert 'WHEELHOUSE=${WHEELHOUSE:-/wheelhouse}' in install and '--no-index --find-links "$WHEELHOUSE"' in install
    assert in_build_context("wheelhouse/README.md") and in_build_context("wheelhouse/torch-2.13.0-x.whl")


def test_the_image_carries_oci_labels_and_the_packages_version() -> None:
    label = " ".join(i.argument for i in FINAL if i.keyword == "LABEL")
    for key, arg in (("version", "VERSION"), ("revision", "REVISION"), ("source", "SOURCE")):
        assert f'org.opencontainers.image.{key}="${{{arg}}}"' in label
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert re.search(rf"^ARG VERSION={re.escape(version)}$", TEXT, flags=re.M), "VERSION must follow pyproject"


def test_the_build_context_leaves_out_runs_corpus_venvs_and_bench_results() -> None:
    for path in ("runs/run1/checkpoint.pt", "corpus/data/book.txt", ".venv/bin/python", ".venv-lmeval/x",
                 "bench/results/image_check.json", "wheel.whl", "tests/conftest.py"):
        assert not in_build_context(path), path
    for path in ("docker/install.sh", "docker/apt-ca.sh", "docker/healthcheck.py", "setup.py", "service/api/app.py"):
        assert in_build_context(path), path
    assert last(FINAL, "USER").argument.split(":")[0] not in {"0", "root"}
