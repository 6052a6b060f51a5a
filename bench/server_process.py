"""A served model in a child process, for benchmarks: started on a free loopback port, waited for on /ready,
stopped with SIGTERM (then SIGKILL). Every benchmark that measures the service through HTTP starts it here, so
readiness, the log and shutdown are handled one way.

    with ServerProcess(service_argv(artifact), log_path=logs / "server.log") as server:
        server.wait_ready()
        httpx.post(server.url + "/generate", json=...)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServerNotReady(RuntimeError):
    """The server exited, or did not answer /ready with 200 in time; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service_argv(artifact: str | Path | None = None, *flags: str) -> list[str]:
    """`python -m service [ARTIFACT] [FLAGS]` with this interpreter (no artifact: the shipped model)."""
    return [sys.executable, "-m", "service", *([str(artifact)] if artifact else []), *flags]


class ServerProcess:
    """`argv` plus `--host 127.0.0.1 --port N` in a child process, its stdout and stderr in `log_path` (or
    discarded). `env` is the child's whole environment (default: this process's)."""

    def __init__(self, argv: Sequence[str], *, log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path = ROOT, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self._log: IO[bytes] | None = log_path.open("wb") if log_path else None
        out = self._log if self._log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, cwd=cwd, env=dict(os.environ if env is None else env),
                                     stdout=out, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int | None = 2000) -> str:
        """The last `chars` characters of the log (None: all of it)."""
        if self.log_path is None:
            return "(log discarded)"
        if self._log is not None and not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if chars is None else text[-chars:]

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Seconds until /ready answered 200 (warm-up included); ServerNotReady if the process exits first or
        `timeout_s` passes."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerNotReady(f"{self.argv[:4]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() - start > timeout_s:
                raise ServerNotReady(f"{self.argv[:4]} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(poll_s)

    def info(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/info", timeout=10).json())

    def peak_rss_mb(self) -> float:
        """The child's peak resident memory (VmHWM) in MB; NaN where /proc does not say."""
        try:
            lines = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        except OSError:
            return float("nan")
        for line in lines:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
        return float("nan")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit code (negative: the signal that ended it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
        return int(self.proc.returncode)

    @classmethod
    def ready(cls, argv: Sequence[str], timeout_s: float = 300.0, **kwargs: Any) -> ServerProcess:
        """Started and waited for on /ready; on ServerNotReady the process is stopped before it is raised."""
        server = cls(argv, **kwargs)
        try:
            server.wait_ready(timeout_s)
        except ServerNotReady:
            server.stop()
            raise
        return server

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
