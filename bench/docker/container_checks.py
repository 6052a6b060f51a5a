"""The checks bench/docker/image_check.py runs on a built image: each starts containers as a user would
(`docker run`, read-only root file system and a tmpfs /tmp, the port and address chosen by REFORMER_PORT and
REFORMER_HOST), talks to them on loopback (host network) and returns its figures and whether it passed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.docker.docker_host import Docker

HOST = "127.0.0.1"
GRACE_PERIOD_S = 20
# The same requests go to the container and to the service run from the venv; greedy, so the answers are
# the model's own and must be equal to the bit.
# (a seed too: /generate's details report the seed, drawn per request when none is given)
GENERATE = {"inputs": "The history of the city begins",
            "parameters": {"max_new_tokens": 48, "details": True, "seed": 7}}
STREAM = {"inputs": "In the morning the", "parameters": {"max_new_tokens": 32, "seed": 7}}
EMBED = {"inputs": ["a long document about rivers", "Reformer attention hashes the keys"]}
LONG_PROMPT_BYTES = 60_000  # a long prompt's prefill, under way when `docker stop` comes
STOP_AFTER_S = 0.5


def run_container(docker: Docker, image: str, name: str, port: int, *extra: str, env: dict[str, str] | None = None,
                  command: tuple[str, ...] = ()) -> None:
    docker("rm", "-f", name, check=False)
    variables = {"REFORMER_HOST": HOST, "REFORMER_PORT": str(port), "REFORMER_GRACE_PERIOD_S": str(GRACE_PERIOD_S),
                 **(env or {})}
    argv = ["run", "-d", "--name", name, "--network", "host", "--read-only", "--tmpfs", "/tmp", *extra]
    for key, value in variables.items():
        argv += ["-e", f"{key}={value}"]
    docker(*argv, image, *command)


def wait_ready(docker: Docker, name: str, url: str, timeout: float) -> float:
    """Seconds until /ready answers 200; raises with the container's log if it never does."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        state = docker("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        if state == "exited":
            break
        time.sleep(0.25)
    raise RuntimeError(f"{name} not ready after {timeout} s:\n{docker('logs', '--tail', '40', name).stderr}")


def health(docker: Docker, name: str) -> dict[str, Any]:
    return json.loads(docker("inspect", "--format", "{{json .State.Health}}", name).stdout)


def wait_healthy(docker: Docker, name: str, timeout: float) -> tuple[float | None, str]:
    """Seconds until Docker's own HEALTHCHECK reports healthy (its first probe runs one interval after start)."""
    start = time.monotonic()
    status = "none"
    while time.monotonic() - start < timeout:
        status = health(docker, name)["Status"]
        if status == "healthy":
            return time.monotonic() - start, status
        time.sleep(1)
    return None, status


def sse_tokens(text: str) -> list[Any]:
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return [(e.get("token"), e.get("generated_text")) for e in events]


def answers(url: str) -> dict[str, Any]:
    """The answers to the fixed requests, without the timing the server adds."""
    generated = httpx.post(url + "/generate", json=GENERATE, timeout=120)
    generated.raise_for_status()
    streamed = httpx.post(url + "/generate_stream", json=STREAM, timeout=120)
    streamed.raise_for_status()
    embedded = httpx.post(url + "/embed", json=EMBED, timeout=120)
    embedded.raise_for_status()
    return {"generate": generated.json(), "generate_stream": sse_tokens(streamed.text), "embed": embedded.json()}


def compare(image: dict[str, Any], venv: dict[str, Any]) -> dict[str, bool]:
    return {route: image[route] == venv[route] for route in venv}


def whoami(docker: Docker, name: str) -> int:
    return int(docker("exec", name, "python3", "-c", "import os; print(os.getuid())").stdout.strip())


def stop_during_prefill(docker: Docker, name: str, url: str) -> dict[str, Any]:
    """`docker stop` while a long prompt is being prefilled: the request must still get its whole answer and the
    container exit 0 within REFORMER_GRACE_PERIOD_S."""
    prompt = ("The river runs past the old mill and under the stone bridge. " * 2000)[:LONG_PROMPT_BYTES]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 16}}
    outcome: dict[str, Any] = {}

    def send() -> None:
        started = time.monotonic()
        try:
            response = httpx.post(url + "/generate", json=body, timeout=120)
            outcome.update(status=response.status_code, tokens=response.headers.get("x-generated-tokens"),
                           prompt_tokens=response.headers.get("x-prompt-tokens"),
                           inference_ms=response.headers.get("x-inference-time"))
        except httpx.HTTPError as err:
            outcome.update(status=None, error=repr(err))
        outcome["request_s"] = time.monotonic() - started

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(STOP_AFTER_S)  # the request is in: its prefill takes seconds on 2 cores
    stop_start = time.monotonic()
    docker("stop", "-t", str(GRACE_PERIOD_S + 15), name, timeout=GRACE_PERIOD_S + 60)
    stop_s = time.monotonic() - stop_start
    sender.join(120)
    exit_code = int(docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())
    passed = (outcome.get("status") == 200 and outcome.get("tokens") == "16" and exit_code == 0
              and stop_s <= GRACE_PERIOD_S and outcome["request_s"] > STOP_AFTER_S)
    return {"passed": passed, "stop_sent_after_s": STOP_AFTER_S, "stop_s": round(stop_s, 2), "exit_code": exit_code,
            "grace_period_s": GRACE_PERIOD_S, "request": outcome}


def memory_limit_refusal(docker: Docker, image: str) -> dict[str, Any]:
    """REFORMER_CACHE_BYTES above `--memory`: refused at start-up, before the model loads."""
    start = time.monotonic()
    result = docker("run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--memory", "1g",
                    "-e", f"REFORMER_CACHE_BYTES={2 << 30}", image, check=False, timeout=120)
    seconds = time.monotonic() - start
    message = next((line.strip() for line in result.stderr.splitlines() if "memory limit" in line), "")
    return {"passed": result.returncode == 2 and "does not fit the container's memory limit" in message,
            "exit_code": result.returncode, "seconds": round(seconds, 2), "message": message}


def restart_after_kill(docker: Docker, image: str, name: str, port: int) -> dict[str, Any]:
    """`--restart unless-stopped` after the server is killed: how long until /ready answers 200 again.

    Docker counts `docker kill` as a manual stop, which this policy does not undo (the container stays exited;
    recorded here), so the crash is what an OOM kill or a fault does: SIGKILL to the container's process from
    the host."""
    url = f"http://{HOST}:{port}"
    run_container(docker, image, name, port, "--restart", "unless-stopped")
    try:
        wait_ready(docker, name, url, 120)
        docker("kill", name)
        time.sleep(5)
        after_docker_kill = docker("inspect", "--format", "{{.State.Status}} {{.RestartCount}}", name).stdout.split()
        docker("start", name)
        wait_ready(docker, name, url, 120)
        pid = int(docker("inspect", "--format", "{{.State.Pid}}", name).stdout.strip())
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while httpx_ready(url):  # the dead server's socket goes with it
            time.sleep(0.05)
        ready_again = wait_ready(docker, name, url, 180)
        restarts = int(docker("inspect", "--format", "{{.RestartCount}}", name).stdout.strip())
        return {"passed": restarts >= 1, "seconds_to_ready": round(time.monotonic() - killed, 2),
                "ready_wait_s": round(ready_again, 2), "restart_count": restarts,
                "after_docker_kill": {"status": after_docker_kill[0], "restart_count": int(after_docker_kill[1])}}
    finally:
        docker("rm", "-f", name, check=False)


def httpx_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def runtime_contents(docker: Docker, image: str) -> dict[str, Any]:
    """What the runtime stage carries that it should not: a compiler, pip's cache, build secrets."""
    script = ("for c in gcc cc g++ c++ clang; do command -v $c; done; "
              "ls -d /root/.cache/pip /home/reformer/.cache/pip /run/secrets/ca 2>/dev/null; true")
    found = docker("run", "--rm", "--network", "none", "--user", "0", "--entrypoint", "sh", image, "-c", script)
    leftovers = found.stdout.split()
    return {"passed": not leftovers, "found": leftovers}


def labels(docker: Docker, image: str) -> dict[str, str]:
    value = json.loads(docker("image", "inspect", "--format", "{{json .Config.Labels}}", image).stdout)
    return {key: val for key, val in (value or {}).items() if key.startswith("org.opencontainers")}


def healthcheck_config(docker: Docker, image: str) -> dict[str, Any]:
    return json.loads(docker("image", "inspect", "--format", "{{json .Config.Healthcheck}}", image).stdout)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
