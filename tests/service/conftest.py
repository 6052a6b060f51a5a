"""Fixtures for the service tests: a tiny artifact, in-process apps, and a real uvicorn subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from export import load_artifact
from service.engine import Engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def artifact(tiny_artifact: Path) -> Any:
    """The shared tiny artifact, loaded."""
    return load_artifact(tiny_artifact)


@pytest.fixture
def started() -> Iterator[list[Engine]]:
    """Engines a test starts (append them); each is stopped after the test."""
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m service` on a loopback port, with its log captured to a file."""

    def __init__(self, artifact_dir: Path, log_path: Path, **settings: Any):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key, value in settings.items():
            env[f"REFORMER_{key.upper()}"] = str(value)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", str(artifact_dir), "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


@pytest.fixture(scope="module")
def server_factory(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Start servers with given settings; all are stopped at the end of the module."""
    started: list[ServerProcess] = []

    def start(**settings: Any) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(tiny_artifact, log_path, **settings)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
