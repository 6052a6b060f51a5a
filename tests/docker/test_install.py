"""The image's install and start steps, run without Docker: what the Dockerfile COPYs goes to a scratch
build context, `docker/install.sh` (the image's only install script: its deps step, then its package step)
installs it into a fresh venv and package folder with the CPU wheels (VARIANT=cpu; torch 2.13.0 from this
machine's disk, held by constraints-cpu.txt so no other torch is ever fetched), then the installed `reformer`
starts exactly as the image's ENTRYPOINT + CMD do (its port chosen by REFORMER_PORT, ENV applied, run from a
directory outside the source), and the HEALTHCHECK command (docker/healthcheck.py) is probed: failing before
the server runs, passing once it does. About a minute, in every CI run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.server_process import free_port
from tests.docker.conftest import REPO
from tests.docker.test_dockerfile import DOCKERFILE, HEALTHCHECK_IN_IMAGE, Instruction, last, parse_stages, stage_named
from tests.docker.test_image_pairing import dockerfile_args


def copy_build_context(stage: list[Instruction], into: Path) -> None:
    """What the build stage's COPY instructions put in its WORKDIR (Docker's rules for these forms)."""
    for instruction in stage:
        if instruction.keyword != "COPY":
            continue
        *sources, target = shlex.split(instruction.argument)
        for source in sources:
            origin = REPO / source
            into_dir = len(sources) > 1 or target.endswith("/")
            destination = into / target / origin.name if into_dir else into / target
            if origin.is_dir():
                shutil.copytree(origin, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, destination)


def image_env(final: list[Instruction], venv: Path, home: Path) -> dict[str, str]:
    """The final stage's ENV (with PATH pointing at the venv the script made), over a minimal environment."""
    env = {"HOME": str(home), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    for instruction in final:
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.argument):
                name, _, value = pair.partition("=")
                env[name] = value
    env["PATH"] = f"{venv / 'bin'}:{os.environ['PATH']}"
    return env


# CI runs it (`slow` is not deselected there). About 70 CPU-seconds, most of it unpacking torch; the limit
# leaves room for a loaded machine, where the wall time was seen to pass 5 minutes.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_install_script_then_the_image_command_serves_and_passes_its_healthcheck(tmp_path: Path) -> None:
    stages = parse_stages(DOCKERFILE.read_text())
    build, final = stage_named(stages, "build"), stages[-1]
    context = tmp_path / "src"
    copy_build_context(build, context)
    assert (context / "docker/install.sh").is_file()

    venv, app = tmp_path / "venv", tmp_path / "app"
    args = dockerfile_args(DOCKERFILE.read_text())
    env = {**os.environ, "VARIANT": "cpu", "TORCH_VERSION": args["TORCH_VERSION"], "TORCH_INDEX_URL": "",
           "PIP_CONSTRAINT": str(REPO / "constraints-cpu.txt"), "PYTHON": sys.executable, "APP_DIR": str(app),
           "WHEELHOUSE": str(tmp_path / "no-wheelhouse"), "CA_BUNDLE": str(tmp_path / "no-secret"),
           "PIP_NO_COMPILE": "1"}  # the image compiles bytecode; here it would only cost time
    runs = [i.argument for i in build if i.keyword == "RUN"]
    assert [run.rpartition(" docker/install.sh ")[2] for run in runs[-2:]] == ["deps /opt/venv /src",
                                                                                "package /opt/venv /src"]
    assert "gcc" in runs[0], "the build stage installs the compiler the kernels are built with"
    for step in ("deps", "package"):
        installed = subprocess.run(["bash", "docker/install.sh", step, str(venv), str(context)], cwd=context,
                                   env=env, capture_output=True, text=True, timeout=600)
        assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "installed: torch 2.13.0+cpu (CUDA None)" in installed.stdout
    assert "kernels installed:" in installed.stdout
    # the dependencies and the package are apart: the image copies them as two layers
    assert (app / "site" / "service").is_dir() and not list(venv.glob("lib/python*/site-packages/service"))

    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    image = image_env(final, venv, home)
    # no compiler at run time, as in the image's runtime stage: only the venv's programs, and an empty folder
    # where a first-use build of the kernels would go
    image["PATH"] = f"{app / 'site' / 'bin'}:{venv / 'bin'}"
    image["REFORMER_KERNEL_DIR"] = str(tmp_path / "no-first-use-builds")
    assert shutil.which("cc", path=image["PATH"]) is None and shutil.which("gcc", path=image["PATH"]) is None
    # the installed package carries the load test (pyproject's packages), not the benchmarks
    loadtest_help = subprocess.run([str(app / "site" / "bin" / "reformer"), "loadtest", "--help"], cwd=home, env=image,
                                   capture_output=True, text=True, timeout=60)
    assert loadtest_help.returncode == 0 and "--url" in loadtest_help.stdout, loadtest_help.stderr
    no_bench = subprocess.run([str(venv / "bin" / "python"), "-c", "import bench"], cwd=home, env=image,
                              capture_output=True, text=True, timeout=60)
    assert no_bench.returncode != 0 and "No module named 'bench'" in no_bench.stderr
    # the image's command as it is: the port comes from REFORMER_PORT, as a user's `docker run -e` gives it
    command = last(final, "ENTRYPOINT").exec_form() + last(final, "CMD").exec_form()
    image["REFORMER_PORT"] = str(port)
    probe = [REPO / "docker/healthcheck.py" if part == HEALTHCHECK_IN_IMAGE else part
             for part in parse_healthcheck(last(final, "HEALTHCHECK").argument)]
    assert shutil.which(str(probe[0]), path=image["PATH"]) == str(venv / "bin" / str(probe[0]))

    def probe_passes() -> bool:
        return subprocess.run(probe, cwd=home, env=image, capture_output=True, timeout=30).returncode == 0

    assert not probe_passes(), "the health check passes with no server: it could never fail"
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(command, cwd=home, env=image, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not probe_passes():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "health check never passed"
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        while httpx.get(url + "/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
        info = httpx.get(url + "/info", timeout=5).json()
        assert info["device"] == "cpu"
        # the installed package runs the C kernels it was built with, and says so
        assert info["kernels"]["loaded"] is True and info["kernels"]["source"].startswith("installed:"), info
        assert info["decode_backend"] == "c-fused" and info["runs"]["prefill_attention"] == "c"
        assert not (tmp_path / "no-first-use-builds").exists()
        r = httpx.post(url + "/generate", json={"inputs": "Once", "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 200
        assert httpx.post(url + "/embed", json={"inputs": "the image's own model"}, timeout=60).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()


def parse_healthcheck(argument: str) -> list[str]:
    """The exec-form command after HEALTHCHECK's options."""
    _, _, command = argument.partition(" CMD ")
    value = json.loads(command)
    assert isinstance(value, list), "HEALTHCHECK should use the exec (JSON) form"
    return [str(part) for part in value]
