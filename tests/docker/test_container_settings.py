"""Settings in the container: the image's default command names no flag, so every REFORMER_* variable takes
effect (REFORMER_HOST and REFORMER_PORT included), and its HEALTHCHECK command (docker/healthcheck.py) asks the
address and port the server chose, from the server's flags or its variables. Run here without Docker: the
Dockerfile's own HEALTHCHECK command against a small HTTP server on a free port; bench/docker/image_check.py
checks the same with `docker run`."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.server_process import free_port
from service.settings import Settings, settings_from_argv
from tests.docker.conftest import REPO
from tests.docker.test_dockerfile import DOCKERFILE, HEALTHCHECK_IN_IMAGE, last, parse_stages
from tests.docker.test_install import parse_healthcheck

sys.path.insert(0, str(REPO / "docker"))
import healthcheck  # noqa: E402

FINAL = parse_stages(DOCKERFILE.read_text())[-1]
KEY = "probe-key"


def image_command() -> list[str]:
    return last(FINAL, "ENTRYPOINT").exec_form() + last(FINAL, "CMD").exec_form()


def test_every_variable_takes_effect_with_the_image_command(monkeypatch: pytest.MonkeyPatch) -> None:
    command = image_command()
    assert command[:2] == ["reformer", "serve"]
    for name in Settings.model_fields:  # a flag in the command would override its variable
        assert f"--{name.replace('_', '-')}" not in command, name
    monkeypatch.setenv("REFORMER_HOST", "127.0.0.1")
    monkeypatch.setenv("REFORMER_PORT", "9123")
    monkeypatch.setenv("REFORMER_GRACE_PERIOD_S", "7")
    settings = settings_from_argv(command[2:])
    assert (settings.host, settings.port, settings.grace_period_s) == ("127.0.0.1", 9123, 7.0)


class Health(http.server.BaseHTTPRequestHandler):
    """200 on /health (with the key when the server was started requiring one), 404 elsewhere."""

    require_key = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        keyed = not self.require_key or self.headers.get("Authorization") == f"Bearer {KEY}"
        self.send_response(200 if self.path == "/health" and keyed else 401 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    Health.require_key = False


def probe(env: dict[str, str], *pid: int) -> subprocess.CompletedProcess[str]:
    """The Dockerfile's HEALTHCHECK command, the image's path mapped to the repository's file."""
    command = parse_healthcheck(last(FINAL, "HEALTHCHECK").argument)
    argv = [sys.executable if part == "python3" else str(REPO / "docker/healthcheck.py")
            if part == HEALTHCHECK_IN_IMAGE else part for part in command]
    base = {k: v for k, v in os.environ.items() if not k.startswith("REFORMER_")}
    return subprocess.run([*argv, *map(str, pid)], env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=60)


def test_the_healthcheck_asks_the_port_from_the_variables(server: int) -> None:
    assert probe({"REFORMER_PORT": str(server)}).returncode == 0
    failed = probe({"REFORMER_PORT": str(free_port())})  # nothing listens there: unhealthy
    assert failed.returncode == 1 and "Connection refused" in failed.stderr
    assert probe({"REFORMER_PORT": str(server), "REFORMER_HOST": "127.0.0.1"}).returncode == 0


def test_the_healthcheck_reads_the_servers_flags_over_its_variables(server: int) -> None:
    def stand_in(*flags: str) -> subprocess.Popen[bytes]:  # a process whose command line is `... serve FLAGS`
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "serve", *flags])

    on_port, elsewhere = stand_in("--port", str(server)), stand_in("--port", str(free_port()))
    try:
        assert probe({}, on_port.pid).returncode == 0
        # the flag wins over the variable, in the server and so in the probe
        assert probe({"REFORMER_PORT": str(server)}, elsewhere.pid).returncode == 1
        assert probe({"REFORMER_PORT": str(free_port())}, on_port.pid).returncode == 0
    finally:
        for process in (on_port, elsewhere):
            process.kill()
            process.wait()


def test_the_healthcheck_sends_the_key_when_probes_need_it(server: int) -> None:
    Health.require_key = True
    keyed = {"REFORMER_PORT": str(server), "REFORMER_API_KEY": KEY}
    assert probe(keyed).returncode == 1  # probes are open by default, so the key is not sent
    assert probe({**keyed, "REFORMER_API_KEY_ON_PROBES": "true"}).returncode == 0


@pytest.mark.parametrize(("host", "url"), [("0.0.0.0", "http://127.0.0.1:8000/health"),
                                           ("::", "http://[::1]:8000/health"),
                                           ("10.1.2.3", "http://10.1.2.3:8000/health"),
                                           ("fd00::5", "http://[fd00::5]:8000/health"),
                                           ("reformer.local", "http://reformer.local:8000/health")])
def test_the_probe_reaches_a_server_listening_on_every_interface_on_loopback(host: str, url: str) -> None:
    assert healthcheck.probe_url(Settings(host=host, port=8000)) == url


def test_a_command_line_without_serve_gives_no_flags(tmp_path: Path) -> None:
    assert healthcheck.server_argv(os.getpid()) == []  # pytest's own command line
    assert healthcheck.server_argv(2**22 + 7) == []  # no such process
