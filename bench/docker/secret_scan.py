"""Whether a build secret stayed in an image: every byte of every layer (`docker save`) and the history
(`docker history --no-trunc`) is searched for the certificates the secret held and the base image did not.
A public root from the base image's own bundle is searched alongside and must be found, which shows the scan
reads the layers' file contents."""

from __future__ import annotations

import re
import subprocess
import tarfile
from pathlib import Path
from typing import IO, Any

from bench.docker.docker_host import Docker

CHUNK = 8 << 20
PEM = re.compile(r"-----BEGIN CERTIFICATE-----\n(.*?)\n-----END CERTIFICATE-----", re.S)


def certificates(bundle: str) -> set[str]:
    return {"".join(body.split()) for body in PEM.findall(bundle)}


def marker(cert: str) -> bytes:
    """A 64-character line from the middle of a certificate, as PEM files hold it."""
    lines = [cert[i:i + 64] for i in range(0, len(cert), 64)]
    return lines[len(lines) // 2].encode()


def find_in_stream(stream: IO[bytes], needles: list[bytes]) -> set[bytes]:
    """The needles found in any member of a `docker save` tar (each layer is an uncompressed tar)."""
    found: set[bytes] = set()
    overlap = max(len(n) for n in needles)
    with tarfile.open(fileobj=stream, mode="r|") as archive:
        for member in archive:
            if not member.isfile():
                continue
            extracted = archive.extractfile(member)
            if extracted is None:
                continue
            tail = b""
            while chunk := extracted.read(CHUNK):
                window = tail + chunk
                found.update(n for n in needles if n in window)
                tail = window[-overlap:]
    return found


def scan(docker: Docker, image: str, base_image: str, secret: Path) -> dict[str, Any]:
    base_bundle = docker("run", "--rm", "--network", "none", "--entrypoint", "cat", base_image,
                         "/etc/ssl/certs/ca-certificates.crt").stdout
    public = certificates(base_bundle)
    only_secret = sorted(certificates(secret.read_text()) - public)
    if not only_secret:
        return {"passed": False, "reason": "the secret holds no certificate the base image lacks: nothing to find"}
    secret_markers = [marker(cert) for cert in only_secret]
    control = marker(sorted(public)[0])
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    saver = subprocess.Popen([docker.cli, "save", image], stdout=subprocess.PIPE)
    assert saver.stdout is not None
    found = find_in_stream(saver.stdout, [*secret_markers, control])
    saver.wait(600)
    in_history = [m.decode() for m in secret_markers if m.decode() in history]
    leaked = [m.decode() for m in secret_markers if m in found]
    return {"passed": not leaked and not in_history and control in found and saver.returncode == 0,
            "secret_only_certificates": len(only_secret), "found_in_layers": leaked, "found_in_history": in_history,
            "control_certificate_found": control in found,
            "history_mentions_secret_mount": "--mount=type=secret" in history}
