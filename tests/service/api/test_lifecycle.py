"""Lifecycle: readiness before warm-up, overload (429) and queue timeout (504) over HTTP, SIGTERM drain,
a dying model worker, a corrupt or missing artifact, and unexpected errors."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from bench.server_process import free_port
from service.api.app import create_app
from service.engine.core import Engine
from service.settings import Settings
from tests.service.conftest import REPO, ServerProcess
from tests.service.helpers import metric_value, running_app

pytestmark = pytest.mark.xdist_group("service-lifecycle")

EXIT_AFTER_DRAIN_S = 2.0  # "within a couple of seconds" of the last in-flight request completing
DRAINED_TOKENS = 1800  # the tiny artifact holds 2,048 positions


def test_not_ready_until_warm_up_is_done(artifact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    original = Engine._warm_up

    def slow_warm_up(self: Engine) -> None:
        release.wait(30)
        original(self)

    monkeypatch.setattr(Engine, "_warm_up", slow_warm_up)
    app = create_app(Settings(), artifact)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error_type"] == "unavailable"
        r = client.post("/generate", json={"inputs": "a"})
        assert r.status_code == 503 and "loading" in r.json()["error"]
        by_route = {"route": "/generate", "status": "503"}  # refused before routing, counted under its route
        assert metric_value(client.get("/metrics").text, "reformer_requests_total", by_route) == 1
        release.set()
        app.state.service.engine.ready.wait(30)
        assert client.get("/ready").status_code == 200
        assert client.post("/generate", json={"inputs": "a"}).status_code == 200


def test_liveness_holds_while_the_worker_is_being_started(artifact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine is published to the probes only once its worker runs: a slow start is still "loading"."""
    started = threading.Event()
    original = Engine.start

    def slow_start(self: Engine) -> None:
        started.set()
        time.sleep(1.0)
        original(self)

    monkeypatch.setattr(Engine, "start", slow_start)
    app = create_app(Settings(), artifact)
    with TestClient(app) as client:
        assert started.wait(30)
        assert client.get("/health").status_code == 200  # inside the slow start
        assert client.get("/ready").status_code == 503
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/ready").status_code == 200 and client.get("/health").status_code == 200


def test_unexpected_errors_are_a_generic_500_with_the_trace_only_in_the_log(
    artifact: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with running_app(artifact) as client:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(client.app.state.service.engine.backend, "embed", broken)
        r = client.post("/embed", json={"inputs": "a"})
        assert r.status_code == 500
        assert r.json()["error_type"] == "internal"
        assert "secret internal detail" not in r.text and "Traceback" not in r.text
        assert "secret internal detail" in caplog.text
        monkeypatch.undo()
        assert client.post("/embed", json={"inputs": "a"}).status_code == 200  # the worker lives on


def test_queue_full_gets_429_and_queue_timeout_gets_504(server_factory: Any) -> None:
    # the queue timeout must run out well before the hog's ~2000 decode steps end, even on an idle machine:
    # on the PyTorch decode path a tiny model decodes a token in about a millisecond (the C step's 0.14 ms
    # would end them within the timeout)
    server = server_factory(backend="torch", max_batch_size=1, max_queue_size=2, request_timeout_s=1,
                            max_new_tokens=4096, cpu_kernels=False)
    hog = {"prompt": "hog", "max_tokens": 2000, "ignore_eos": True, "stream": True}  # within the 2048 positions
    queued_body = {"inputs": "queued", "parameters": {"max_new_tokens": 2}}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=hog) as r:
        lines = r.iter_lines()  # kept referenced: a collected iterator closes the stream
        next(lines)  # the hog holds the only decode slot
        results: list[httpx.Response] = []
        waiters = [threading.Thread(target=lambda: results.append(httpx.post(
            server.url + "/generate", json=queued_body, timeout=60))) for _ in range(2)]
        for t in waiters:
            t.start()
        deadline = 0
        while metric_value(c.get("/metrics").text, "reformer_queue_size", {"kind": "generate"}) < 2:
            deadline += 1
            assert deadline < 3000, "the two requests never queued"
        over = c.post("/generate", json=queued_body)
        assert over.status_code == 429
        assert over.json()["error_type"] == "overloaded"
        assert int(over.headers["retry-after"]) >= 1
        for t in waiters:
            t.join(60)
    assert [w.status_code for w in results] == [504, 504]
    assert all(w.json()["error_type"] == "timeout" for w in results)
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "reformer_requests_rejected_total", {"reason": "queue_full"}) == 1
    assert metric_value(text, "reformer_requests_rejected_total", {"reason": "timeout"}) == 2


def test_sigterm_drains_in_flight_requests_answers_503_and_exits_0(tiny_artifact: Path, tmp_path: Path) -> None:
    # Long enough (seconds, even on a fast machine) that the drain is still under way when /ready and a late
    # request are checked: with 200 tokens the stream once finished, and the process exited, before them.
    server = ServerProcess(tiny_artifact, tmp_path / "server.log", backend="torch", max_new_tokens=DRAINED_TOKENS,
                           grace_period_s=60)
    try:
        server.wait_ready()
        body = {"inputs": "drain me", "parameters": {"max_new_tokens": DRAINED_TOKENS, "ignore_eos": True}}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate_stream",
                                                                          json=body) as stream:
            lines = stream.iter_lines()
            next(lines)  # in flight
            server.proc.send_signal(signal.SIGTERM)
            assert httpx.get(server.url + "/ready", timeout=30).status_code == 503
            refused = httpx.post(server.url + "/generate", json={"inputs": "late"}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
            rest = [line for line in lines if line.startswith("data: ")]
            completed = time.monotonic()
        assert '"finish_reason": "length"' in rest[-1]  # the in-flight request completed
        assert server.proc.wait(60) == 0
        # ...and the process ends right after it, not after seconds of interpreter teardown (3-9 s before).
        assert time.monotonic() - completed < EXIT_AFTER_DRAIN_S
    finally:
        server.stop()
    assert "drained" in server.log()
    assert "exiting with status 0" in server.log()  # ended by the server itself, without interpreter teardown


def test_a_dead_model_worker_makes_the_process_exit_non_zero(tiny_artifact: Path, tmp_path: Path) -> None:
    port = str(free_port())
    script = (
        "import sys\n"
        "from service.engine.generation_steps import GenerationSteps\n"
        "class InjectedFault(BaseException):\n    pass\n"
        "def broken(self):\n    raise InjectedFault('injected fault in the decode loop')\n"
        "GenerationSteps.decode_step = broken\n"
        "from service.api.server import main\n"
        f"sys.exit(main([{str(tiny_artifact)!r}, '--host', '127.0.0.1', '--port', {port!r}, '--backend', 'torch']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.1)
        r = httpx.post(url + "/generate", json={"inputs": "boom", "parameters": {"max_new_tokens": 5}}, timeout=30)
        assert r.status_code == 500 and "injected" not in r.text
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert "model worker died" in output


def test_a_dead_worker_turns_health_503(artifact: Any) -> None:
    with running_app(artifact) as client:
        engine = client.app.state.service.engine
        engine.stop()
        assert client.get("/health").status_code == 503
        assert client.post("/embed", json={"inputs": "a"}).status_code == 503


@pytest.mark.parametrize("damage", ["truncate", "missing"])
def test_a_corrupt_or_missing_artifact_stops_start_up(tiny_artifact: Path, tmp_path: Path, damage: str) -> None:
    broken = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, broken)
    weights = broken / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    result = subprocess.run([sys.executable, "-m", "service", str(broken), "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "model.safetensors" in result.stderr


def test_a_half_cache_for_a_half_model_stops_start_up(tiny_artifact: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "service", str(tiny_artifact), "--port", "0", "--dtype", "bfloat16",
                             "--kv-cache-dtype", "float16"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "kv_cache_dtype=float16 needs a float32 model; this one is bfloat16" in result.stderr
