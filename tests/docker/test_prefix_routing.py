"""Prefix cache across replicas, through a real nginx (Debian's package) on loopback in front of two replicas
of the service (tiny artifact, each its own process) that share one disk-tier folder:
- hashing on the X-Document-Id header, with the key docker/k8s/prefix-cache/ingress-nginx.yaml gives
  ingress-nginx, a session's later questions land on the replica that prefilled its document and restore it
  from that replica's memory tier (requests without the header are spread);
- without affinity (round robin), the second question lands on the other replica, which restores the document
  from the shared folder (the disk tier)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess, free_port, service_argv
from tests.docker.conftest import K8S, load_yaml

NGINX = shutil.which("nginx", path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin")
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/test-deps.sh installs it)")

INGRESS = K8S / "prefix-cache" / "ingress-nginx.yaml"
Replicas = tuple[list[ServerProcess], Path]  # the two servers, and the folder they share
QUESTIONS = ("\nQuestion: who wrote the ledger?\nAnswer:", "\nQuestion: where is the mill?\nAnswer:",
             "\nQuestion: name one ship.\nAnswer:")


def _document(n: int) -> str:
    """A few hundred ASCII characters (one token each), different for each n."""
    return f"Document {n}. " + "The harbour master kept a ledger of every ship, its cargo and its crew. " * 5


def _hash_key() -> str:
    """The nginx variable the Ingress hashes on: the header's, as ingress-nginx writes it into its nginx."""
    key: str = load_yaml(INGRESS)["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert key == "$http_x_document_id"
    return key


@pytest.fixture(scope="module")
def replicas(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    """Two replicas sharing one REFORMER_PREFIX_CACHE_DIR, started together."""
    shared = tmp_path_factory.mktemp("shared-prefix-cache")
    logs = tmp_path_factory.mktemp("replicas")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "REFORMER_PREFIX_CACHE_DIR": str(shared),
           "REFORMER_PREFIX_CACHE_MIN_TOKENS": "16", "REFORMER_PREFILL": "one-piece", "REFORMER_MAX_NEW_TOKENS": "8",
           "REFORMER_PREFIX_CACHE_KEY": "replicas-share-this-key".ljust(32, "-")}
    servers = [ServerProcess(service_argv(tiny_artifact), log_path=logs / f"replica{i}.log", env=env) for i in (0, 1)]
    try:
        for server in servers:
            server.wait_ready(90)
        yield servers, shared
    finally:
        for server in servers:
            server.stop(20)


@pytest.fixture(scope="module")
def proxy(replicas: Replicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """nginx with two front ends over the same two replicas: `affinity` (hash on the session header,
    consistent) and `round_robin` (nginx's default balancing)."""
    assert NGINX is not None
    servers, _ = replicas
    prefix = tmp_path_factory.mktemp("nginx")
    ports = {"affinity": free_port(), "round_robin": free_port()}
    upstream = "".join(f"    server 127.0.0.1:{s.port};\n" for s in servers)
    location = "location / { proxy_pass http://%s; proxy_buffering off; proxy_read_timeout 60s; }"
    # one process (no master, no worker as another user): its round robin alternates strictly, and every
    # path it writes is in the test's own folder
    conf = prefix / "nginx.conf"
    conf.write_text(f"""daemon off;
master_process off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log {prefix}/access.log;
  client_body_temp_path {prefix}/client_body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  upstream affinity {{
    hash {_hash_key()} consistent;
{upstream}  }}
  upstream round_robin {{
{upstream}  }}
  server {{ listen 127.0.0.1:{ports["affinity"]}; {location % "affinity"} }}
  server {{ listen 127.0.0.1:{ports["round_robin"]}; {location % "round_robin"} }}
}}
""")
    proc = subprocess.Popen([NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        for port in ports.values():
            while True:
                assert proc.poll() is None, f"nginx exited: {proc.stdout.read() if proc.stdout else b''!r}"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "nginx did not listen within 10 s"
                    time.sleep(0.05)
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        proc.terminate()
        proc.wait(10)


def _counters(server: ServerProcess) -> dict[str, float]:
    """The replica's prefix-cache counters: tokens looked up, and hit by tier."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {"queries": 0.0, "memory": 0.0, "disk": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "reformer_prefix_cache_queries_tokens_total":
                out["queries"] += sample.value
            elif sample.name == "reformer_prefix_cache_hits_tokens_total":
                out[sample.labels["tier"]] += sample.value
    return out


def _ask(url: str, doc: str, question: str, session: str | None = None) -> int:
    """One question about `doc`, declared as the cached part; the cached tokens the response reports."""
    headers = {"X-Document-Id": session} if session else {}
    body = {"inputs": doc + question,
            "parameters": {"max_new_tokens": 2, "details": True, "cache_prefix_chars": len(doc)}}
    r = httpx.post(url + "/generate", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    cached = int(r.json()["details"]["cached_tokens"])
    assert int(r.headers["x-cached-tokens"]) == cached
    return cached


def _served(servers: list[ServerProcess], before: list[dict[str, float]]) -> int:
    """Which replica looked the request up (its queries counter moved; the other's did not)."""
    moved = [i for i, s in enumerate(servers) if _counters(s)["queries"] > before[i]["queries"]]
    assert len(moved) == 1, moved
    return moved[0]


def test_a_session_returns_to_the_replica_that_holds_its_document(
    replicas: Replicas, proxy: dict[str, str]
) -> None:
    servers, _ = replicas
    # sessions until each replica holds at least one: which replica a key hashes to is nginx's choice
    sessions: dict[int, tuple[str, str]] = {}
    for n in range(16):
        session, doc = f"reader-{n}", _document(n)
        before = [_counters(s) for s in servers]
        assert _ask(proxy["affinity"], doc, QUESTIONS[0], session) == 0  # a new document: prefilled
        sessions.setdefault(_served(servers, before), (session, doc))
        if len(sessions) == 2:
            break
    assert len(sessions) == 2, "16 session keys all hashed to one replica"
    for replica, (session, doc) in sessions.items():
        for question in QUESTIONS[1:]:  # two in a row: a round robin would send the second elsewhere
            before = [_counters(s) for s in servers]
            assert _ask(proxy["affinity"], doc, question, session) == len(doc)
            assert _served(servers, before) == replica  # the warm replica answered
            after = _counters(servers[replica])
            assert after["memory"] - before[replica]["memory"] == len(doc)  # from its memory tier
            assert after["disk"] == before[replica]["disk"]


def test_requests_without_a_session_header_are_spread(replicas: Replicas, proxy: dict[str, str]) -> None:
    servers, _ = replicas
    served = set()
    for n in range(2):  # nginx's hash falls back to round robin on an empty key: one each
        before = [_counters(s) for s in servers]
        _ask(proxy["affinity"], _document(200 + n), QUESTIONS[0])
        served.add(_served(servers, before))
    assert served == {0, 1}


def test_without_affinity_another_replica_restores_the_document_from_the_shared_folder(
    replicas: Replicas, proxy: dict[str, str]
) -> None:
    servers, shared = replicas
    doc = _document(100)
    files = set(shared.glob("*.safetensors"))
    before = [_counters(s) for s in servers]
    assert _ask(proxy["round_robin"], doc, QUESTIONS[0]) == 0
    first = _served(servers, before)
    deadline = time.monotonic() + 10  # the state is written to the folder after the answer, off its path
    while not set(shared.glob("*.safetensors")) - files:
        assert time.monotonic() < deadline, "the first replica wrote no file to the shared folder"
        time.sleep(0.05)
    before = [_counters(s) for s in servers]
    assert _ask(proxy["round_robin"], doc, QUESTIONS[1]) == len(doc)
    second = _served(servers, before)
    assert second != first  # round robin: the replica that never prefilled this document
    after = _counters(servers[second])
    assert after["disk"] - before[second]["disk"] == len(doc)  # restored from the shared folder
    assert after["memory"] == before[second]["memory"]
