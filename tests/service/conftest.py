"""Fixtures for the service tests: a tiny artifact, in-process apps, and a real uvicorn subprocess."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.server_process import ServerProcess as BenchServerProcess
from bench.server_process import service_argv
from export import load_artifact
from service.engine.core import Engine

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


class ServerProcess(BenchServerProcess):
    """`python -m service ARTIFACT` on a loopback port with `threads` torch threads (OMP_NUM_THREADS), `settings`
    as REFORMER_* variables, its log captured to a file."""

    def __init__(self, artifact_dir: Path, log_path: Path, threads: int = 1, **settings: Any):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
               **{f"REFORMER_{key.upper()}": str(value) for key, value in settings.items()}}
        super().__init__(service_argv(artifact_dir), log_path=log_path, env=env, cwd=REPO)

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.1) -> float:
        return super().wait_ready(timeout_s, poll_s)

    def log(self) -> str:
        return self.log_tail(None)

    def stop(self, timeout_s: float = 30.0) -> int:
        return super().stop(timeout_s)


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
