"""The Docker side of bench/docker/image_check.py: a daemon (started when none runs), a client that builds
with BuildKit, a base image (made from Debian's packages when Docker Hub cannot be reached), and timed builds.

Everything goes through the `docker` command line, as a user's would."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HUB_IMAGE = "python:3.12-slim-bookworm"  # the Dockerfile's default PYTHON_IMAGE
DEBIAN_BASE = "reformer-base:bookworm"


def run(argv: list[str], *, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")
    return result


def docker_client() -> str:
    """A client that builds with BuildKit: `docker` with its buildx plugin (BuildKit by default), else one that
    still has the built-in BuildKit builder behind DOCKER_BUILDKIT=1 (Docker < 23, Debian's docker.io)."""
    chosen = os.environ.get("DOCKER")
    if chosen:
        return chosen
    for candidate in ("docker", "/usr/bin/docker"):
        path = shutil.which(candidate)
        if path is None:
            continue
        if run([path, "buildx", "version"], check=False, timeout=30).returncode == 0:
            return path
        version = run([path, "version", "--format", "{{.Client.Version}}"], check=False, timeout=30).stdout
        if version and int(version.split(".")[0]) < 23:
            return path
    raise RuntimeError("no docker client that builds with BuildKit: install docker-buildx, or Debian's docker.io")


@dataclass
class Docker:
    cli: str

    def __call__(self, *args: str, timeout: float = 600, check: bool = True,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        return run([self.cli, *args], timeout=timeout, check=check, cwd=cwd,
                   env={**os.environ, "DOCKER_BUILDKIT": "1"})

    def ensure_daemon(self) -> str:
        """Start dockerd (niced: builds are heavy on a shared machine) when no daemon answers; say which."""
        if self("info", check=False, timeout=60).returncode == 0:
            return "running"
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise RuntimeError("no Docker daemon and no dockerd: apt-get install docker.io")
        log = open("/tmp/image_check-dockerd.log", "ab")  # noqa: SIM115 - the daemon outlives this process
        subprocess.Popen(["nice", "-n", "10", dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while self("info", check=False, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("dockerd did not answer within 60 s (/tmp/image_check-dockerd.log)")
            time.sleep(1)
        return "started"

    def has_image(self, tag: str) -> bool:
        return self("image", "inspect", tag, check=False, timeout=60).returncode == 0

    def base_image(self) -> tuple[str, str]:
        """The PYTHON_IMAGE to build on, and where it came from: Docker Hub's python image when it can be pulled,
        else one made from Debian's packages (bench/docker/base_image.sh)."""
        if self.has_image(HUB_IMAGE) or self("pull", HUB_IMAGE, check=False, timeout=120).returncode == 0:
            return HUB_IMAGE, "docker hub"
        if not self.has_image(DEBIAN_BASE):
            run(["nice", "-n", "10", str(ROOT / "bench/docker/base_image.sh"), DEBIAN_BASE],
                env={**os.environ, "DOCKER": self.cli}, timeout=1800)
            return DEBIAN_BASE, "made with debootstrap (Docker Hub unreachable)"
        return DEBIAN_BASE, "debootstrap image made earlier (Docker Hub unreachable)"

    def size(self, tag: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


@dataclass
class Build:
    tag: str
    seconds: float
    context_bytes: int | None
    log: str


_UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def context_bytes(log: str) -> int | None:
    """The build context's size as BuildKit reports its transfer (the last figure of `load build context`)."""
    found = re.findall(r"transferring context: ([\d.]+)([kKMG]?B)", log)
    if not found:
        return None
    value, unit = found[-1]
    return int(float(value) * _UNITS[unit])


def build(docker: Docker, tag: str, context: Path, build_args: dict[str, str], *,
          secret_ca: Path | None, log_path: Path) -> Build:
    argv = ["build", "--network", "host", "--progress", "plain", "-t", tag, "-f", str(context / "Dockerfile")]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    if secret_ca is not None:
        argv += ["--secret", f"id=ca,src={secret_ca}"]
    start = time.monotonic()
    result = docker(*argv, str(context), timeout=3600, check=False, cwd=context)
    seconds = time.monotonic() - start
    log = result.stdout + result.stderr
    log_path.write_text(log)
    if result.returncode != 0:
        raise RuntimeError(f"docker build {tag} failed ({log_path}):\n{log[-4000:]}")
    return Build(tag, seconds, context_bytes(log), log)


def copy_context(into: Path) -> Path:
    """The repository's files as a clone would have them (tracked, and untracked but not ignored): what a user
    builds from, without this checkout's local wheels or build outputs."""
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into
