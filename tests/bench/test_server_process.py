"""bench/server_process.py: the benchmarks' one way to start a server, wait for /ready and stop it, driven
against a tiny stand-in HTTP server (a real service is started by the benchmarks' own tests)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from bench.server_process import ServerNotReady, ServerProcess, free_port, service_argv

# Answers /ready with 503 for its first `delay` requests, then 200; exits 0 on SIGTERM.
STAND_IN = textwrap.dedent("""
    import argparse, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--delay", type=int, default=0)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    seen = [0]
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen[0] += 1
            ok = self.path == "/info" or (self.path == "/ready" and seen[0] > args.delay)
            body = b'{"kernels": "none"}' if self.path == "/info" else b"{}"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            print("request", *a, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("listening", args.host, args.port, flush=True)
    HTTPServer((args.host, args.port), Handler).serve_forever()
""")


def stand_in(*flags: str) -> list[str]:
    return [sys.executable, "-c", STAND_IN, *flags]


def test_waits_for_ready_then_stops_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with ServerProcess(stand_in("--delay", "3"), log_path=log) as server:
        waited = server.wait_ready(30, poll_s=0.05)
        assert waited >= 0
        assert httpx.get(server.url + "/ready").status_code == 200
        assert server.info() == {"kernels": "none"}
        assert server.peak_rss_mb() > 0
    assert server.proc.returncode == 0
    assert f"listening 127.0.0.1 {server.port}" in log.read_text()
    assert log.read_text().count("request") >= 4  # three 503s were waited through


def test_an_exit_before_ready_names_the_code_and_the_log(tmp_path: Path) -> None:
    server = ServerProcess([sys.executable, "-c", "import sys; print('bad artifact'); sys.exit(3)"],
                           log_path=tmp_path / "server.log")
    with pytest.raises(ServerNotReady, match=r"exited with 3:\nbad artifact"):
        server.wait_ready(30, poll_s=0.05)
    assert server.stop() == 3


def test_ready_stops_a_server_that_never_gets_ready(tmp_path: Path) -> None:
    with pytest.raises(ServerNotReady, match="not ready after 1 s") as failed:
        ServerProcess.ready(stand_in("--delay", "1000000"), timeout_s=1, log_path=tmp_path / "server.log")
    assert "listening" in str(failed.value)
    with ServerProcess.ready(stand_in(), timeout_s=30) as server:
        assert httpx.get(server.url + "/ready").status_code == 200
    assert server.proc.returncode == 0


def test_never_ready_times_out_and_stop_ends_it(tmp_path: Path) -> None:
    server = ServerProcess(stand_in("--delay", "1000000"), log_path=tmp_path / "server.log")
    try:
        with pytest.raises(ServerNotReady, match="not ready after 1 s"):
            server.wait_ready(1, poll_s=0.05)
    finally:
        assert server.stop(10) == 0


def test_a_given_port_and_a_discarded_log() -> None:
    port = free_port()
    with ServerProcess(stand_in(), port=port) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        server.wait_ready(30, poll_s=0.05)
        assert server.log_tail() == "(log discarded)"


def test_service_argv() -> None:
    assert service_argv() == [sys.executable, "-m", "service"]
    assert service_argv(Path("art"), "--log-level", "warning") == [
        sys.executable, "-m", "service", "art", "--log-level", "warning"]
