"""The image's HEALTHCHECK: GET /health on the address and port the server chose.

The server takes its settings from flags over REFORMER_* variables over defaults (service/settings.py); the
probe reads the same: the flags from the server's own command line (/proc/PID/cmdline, PID 1 in a
container: `reformer serve ...`) and the variables from its environment, which Docker gives both alike.
So `docker run -e REFORMER_PORT=9000 IMAGE` and `docker run IMAGE serve --port 9000` are probed on 9000.

    python3 docker/healthcheck.py [PID]     exit 0: healthy; 1: not (the reason on stderr)
"""

from __future__ import annotations

import ipaddress
import sys
import urllib.request
from pathlib import Path

from service.settings import Settings, settings_from_argv

TIMEOUT_S = 4.0  # under the HEALTHCHECK's --timeout


def server_argv(pid: int) -> list[str]:
    """The flags after `serve` on the server's command line; none when it is not `reformer serve`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []
    return [arg for arg in argv[argv.index("serve") + 1:] if arg] if "serve" in argv else []


def probe_url(settings: Settings) -> str:
    """Where to reach the server from inside its container: loopback when it listens on every interface."""
    host = settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    return f"http://{host}:{settings.port}/health"


def main(argv: list[str]) -> int:
    pid = int(argv[0]) if argv else 1
    try:
        settings = settings_from_argv(server_argv(pid))
    except (Exception, SystemExit) as err:  # the server refuses these settings too: not running healthily
        print(f"healthcheck: invalid settings: {err}", file=sys.stderr)
        return 1
    request = urllib.request.Request(probe_url(settings))
    if settings.api_key is not None and settings.api_key_on_probes:
        request.add_header("Authorization", f"Bearer {settings.api_key.get_secret_value()}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except OSError as err:
        print(f"healthcheck: {request.full_url}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
