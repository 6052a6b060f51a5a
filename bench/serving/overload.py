"""Overload benchmark (issue 8): at four times the queue's capacity, the excess must get 429 with Retry-After
within 50 ms, every admitted request must complete, and memory must stay bounded; a request that waits
past the timeout must get 504.

What is timed is the server, not the client: every connection is opened and used once (GET /health) before
the burst, the requests are pre-built and written back to back on raw sockets, and each 429 is timed from
its write to the kernel's arrival stamp of its status line (SO_TIMESTAMPNS), so a client short of CPU
does not inflate it. Also reported: when the client got round to reading it, the in-server duration of
each 429 from the server's access log, and the load average around the burst.

    python bench/serving/overload.py [--artifact DIR | --url URL] [--out bench/results/overload.json]

Without --url it starts `python -m service` itself (two servers: one for the burst, one with a short
request timeout for the 504 probe). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402

REJECT_BUDGET_S = 0.050
# Linux's SO_TIMESTAMPNS (Python names it only on some builds): the kernel stamps each received packet with
# CLOCK_REALTIME, so a response's arrival is known whenever the client gets round to reading it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESTAMP_CMSG_SPACE = socket.CMSG_SPACE(16)


@contextmanager
def local_server_process(artifact: str | None, log_path: Path, **settings: Any) -> Iterator[ServerProcess]:
    """`python -m service` on a free loopback port, ready, until the block ends (SIGTERM, then wait); its log
    (JSON lines at info, one access line per request with the in-server duration) goes to `log_path`."""
    env = {**os.environ, **{f"REFORMER_{k.upper()}": str(v) for k, v in settings.items()}}
    argv = service_argv(artifact, "--log-level", "info", "--log-json")
    with ServerProcess(argv, log_path=log_path, env=env, cwd=REPO) as server:
        server.wait_ready(180, poll_s=0.1)
        yield server


@contextmanager
def local_server(artifact: str | None, log_path: Path, **settings: Any) -> Iterator[str]:
    """`local_server_process`'s URL."""
    with local_server_process(artifact, log_path, **settings) as server:
        yield server.url


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def server_durations_ms(log_path: Path, path: str, status: int) -> list[float]:
    """In-server durations of the requests the access log recorded with this path and status."""
    durations = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("logger") == "service.access" and entry.get("path") == path and entry.get("status") == status:
            durations.append(float(entry["duration_ms"]))
    return durations


@dataclass
class Exchange:
    """One request on its own pre-opened connection, timed at the socket."""

    sock: socket.socket
    sent_ns: int = 0
    first_byte_ns: int | None = None  # kernel arrival of the response's first bytes (its status line)
    first_read_ns: int | None = None  # when this process got round to reading them
    done_ns: int | None = None
    data: bytearray = field(default_factory=bytearray)
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def receive(self) -> bool:
        """Read what has arrived; True once the whole response (or the connection's end) is in."""
        chunk, ancillary, _, _ = self.sock.recvmsg(65536, TIMESTAMP_CMSG_SPACE)
        now = time.time_ns()
        if self.first_read_ns is None and chunk:
            self.first_read_ns = now
            self.first_byte_ns = now
            for level, kind, stamp in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(stamp) >= 16:
                    seconds, nanoseconds = struct.unpack("qq", stamp[:16])
                    self.first_byte_ns = seconds * 1_000_000_000 + nanoseconds
        self.data += chunk
        head_end = self.data.find(b"\r\n\r\n")
        if self.status is None and head_end >= 0:
            status_line, *header_lines = self.data[:head_end].decode("latin-1").split("\r\n")
            self.status = int(status_line.split(" ", 2)[1])
            self.headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        complete = self.status is not None and len(self.data) >= head_end + 4 + int(
            self.headers.get("content-length", "0"))
        if complete or not chunk:
            self.done_ns = now
            return True
        return False


def open_warm_connections(url: str, count: int) -> list[Exchange]:
    """`count` keep-alive connections, each already used once (GET /health): the burst then measures the
    server, not connection set-up in a client that may itself be short of CPU."""
    parsed = urlsplit(url)
    exchanges = []
    for _ in range(count):
        sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 80))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        exchanges.append(Exchange(sock))
    for warm in exchanges:
        warm.sock.sendall(f"GET /health HTTP/1.1\r\nHost: {parsed.netloc}\r\n\r\n".encode())
    for warm in exchanges:
        while not warm.receive():
            pass
        if warm.status != 200 or warm.headers.get("connection") == "close":
            raise RuntimeError(f"warm-up GET /health answered {warm.status}")
    return [Exchange(warm.sock) for warm in exchanges]


def post_request(url: str, path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


def send_burst(exchanges: list[Exchange], request: bytes, timeout_s: float = 600.0) -> None:
    """Write the same request on every connection back to back, then collect every response."""
    for exchange in exchanges:
        exchange.sent_ns = time.time_ns()
        exchange.sock.sendall(request)
    with selectors.DefaultSelector() as selector:
        for exchange in exchanges:
            selector.register(exchange.sock, selectors.EVENT_READ, exchange)
        deadline = time.monotonic() + timeout_s
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                if key.data.receive():
                    selector.unregister(key.fileobj)
    for exchange in exchanges:
        exchange.sock.close()


def sample_memory(url: str, stop: threading.Event, rss: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            rss.append(metric(client.get("/metrics").text, "process_resident_memory_bytes"))
            stop.wait(0.25)


def burst(url: str, count: int, new_tokens: int, log_path: Path | None) -> dict[str, Any]:
    """Send `count` generation requests at once on warm connections; time each from its write to the arrival
    of its status line (kernel timestamp), and to when this process read it; the server's own figure for
    each 429 comes from its access log."""
    body = {"inputs": "overload " * 8, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    exchanges = open_warm_connections(url, count)
    request = post_request(url, "/generate", body)
    rss: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(url, stop, rss), daemon=True)
    load_before = os.getloadavg()
    sampler.start()
    while not rss:
        time.sleep(0.01)
    send_burst(exchanges, request)
    stop.set()
    sampler.join(30)
    load_after = os.getloadavg()
    rejected = [e for e in exchanges if e.status == 429]
    ok = [e for e in exchanges if e.status == 200]
    other = [e for e in exchanges if e.status not in (200, 429)]
    arrival = [(e.first_byte_ns - e.sent_ns) / 1e6 for e in rejected if e.first_byte_ns is not None]
    read = [(e.first_read_ns - e.sent_ns) / 1e6 for e in rejected if e.first_read_ns is not None]
    in_server = server_durations_ms(log_path, "/generate", 429) if log_path is not None else []
    return {
        "requests": count,
        "completed_200": len(ok),
        "rejected_429": len(rejected),
        "other_status": sorted({e.status or 0 for e in other}),
        "other_count": len(other),
        "rejected_with_retry_after": sum(1 for e in rejected if e.headers.get("retry-after")),
        "reject_status_line_p50_ms": percentile(arrival, 0.5),
        "reject_status_line_p99_ms": percentile(arrival, 0.99),
        "reject_status_line_max_ms": max(arrival, default=float("nan")),
        "rejects_within_50ms": sum(1 for x in arrival if x <= REJECT_BUDGET_S * 1000),
        "reject_client_read_p50_ms": percentile(read, 0.5),
        "reject_client_read_p99_ms": percentile(read, 0.99),
        "reject_in_server_count": len(in_server),
        "reject_in_server_p50_ms": percentile(in_server, 0.5),
        "reject_in_server_p99_ms": percentile(in_server, 0.99),
        "reject_in_server_max_ms": max(in_server, default=float("nan")),
        "admitted_latency_p50_s": percentile([(e.done_ns or 0) / 1e9 - e.sent_ns / 1e9 for e in ok], 0.5),
        "rss_before_mb": rss[0] / 2**20,
        "rss_peak_mb": max(rss) / 2**20,
        "rss_after_mb": rss[-1] / 2**20,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "cpu_count": os.cpu_count(),
    }


async def timeout_probe(url: str, count: int, new_tokens: int) -> dict[str, Any]:
    """Saturate a server whose request timeout is short: the ones left waiting must get 504."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        body = {"inputs": "slow", "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}

        async def one() -> tuple[int, float]:
            started = time.perf_counter()
            r = await client.post("/generate", json=body)
            return r.status_code, time.perf_counter() - started

        results = await asyncio.gather(*(one() for _ in range(count)))
    timed_out = [t for s, t in results if s == 504]
    return {"requests": count, "timeout_504": len(timed_out),
            "completed_200": sum(1 for s, _ in results if s == 200),
            "other_count": sum(1 for s, _ in results if s not in (200, 504)),
            "timeout_latency_median_s": statistics.median(timed_out) if timed_out else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", help="artifact to serve (default: the shipped one)")
    parser.add_argument("--url", help="a running server to use instead of starting one (burst only)")
    parser.add_argument("--queue-size", type=int, default=16, help="max_queue_size of the started server")
    parser.add_argument("--batch-size", type=int, default=4, help="max_batch_size of the started server")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--timeout-s", type=float, default=0.5, help="request_timeout_s for the 504 probe")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "overload.json"))
    args = parser.parse_args(argv)

    report: dict[str, Any] = {}
    if args.url:
        info = httpx.get(args.url + "/info", timeout=30).json()["batching"]
        capacity = info["max_queue_size"] + info["max_batch_size"]
        report["burst"] = burst(args.url, 4 * capacity, args.new_tokens, None)  # no server log: no in-server figure
    else:
        capacity = args.queue_size + args.batch_size
        logs = Path(tempfile.mkdtemp(prefix="overload-"))
        with local_server(args.artifact, logs / "burst.log", max_queue_size=args.queue_size,
                          max_batch_size=args.batch_size, max_new_tokens=max(args.new_tokens, 1024)) as url:
            report["burst"] = burst(url, 4 * capacity, args.new_tokens, logs / "burst.log")
        with local_server(args.artifact, logs / "timeout.log", max_queue_size=args.queue_size, max_batch_size=1,
                          request_timeout_s=args.timeout_s, max_new_tokens=max(args.new_tokens, 1024)) as url:
            report["timeout"] = asyncio.run(timeout_probe(url, args.queue_size, args.new_tokens * 4))
        print(f"server logs in {logs}")
    report["capacity"] = capacity
    report["reject_budget_ms"] = REJECT_BUDGET_S * 1000

    table = Table(title=f"overload: {4 * capacity} requests at once against capacity {capacity}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for section, figures in report.items():
        if isinstance(figures, dict):
            for key, value in figures.items():
                table.add_row(f"{section}.{key}", f"{value:.2f}" if isinstance(value, float) else str(value))
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
