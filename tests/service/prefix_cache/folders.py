"""Real folders that fail: a tmpfs of a few pages (a full filesystem) and a mount made read-only under a running
server. Both need `mount`, which needs root (CAP_SYS_ADMIN): a CI runner on a fresh VM and the development
container run the tests as root and can mount. `chmod 0555` is no read-only folder for root (root writes
through it), so where mounting is refused the tests fall back: as another user, `chmod 0555` is a real
read-only folder; as root without the right to mount (an unprivileged container), the error is injected at the
writer's first call that touches the folder (`simulated`), and each test says what that leaves unproven."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.prefix_cache import disk as disk_module
from service.prefix_cache.disk import DiskTier


def held_writes(monkeypatch: pytest.MonkeyPatch, most_s: float) -> threading.Event:
    """A folder whose writes hang: each disk-tier write waits until the returned event is set (at most `most_s`
    seconds), then writes."""
    release = threading.Event()
    real = DiskTier.write

    def held(self: DiskTier, key: str, snapshot: object) -> int:
        release.wait(most_s)
        return real(self, key, snapshot)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "write", held)
    return release


def _mount(*args: str) -> str | None:
    """Run `mount` with `args`; None when it worked, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


class Folder:
    """A folder to serve a disk tier from; `kind` says how its faults are made: `tmpfs` (a real mount),
    `chmod` (a real read-only folder for a non-root user) or `simulated`."""

    def __init__(self, path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        self.kind = kind
        self.monkeypatch = monkeypatch

    @property
    def really_read_only(self) -> bool:
        return self.kind != "simulated"

    @property
    def really_full(self) -> bool:
        return self.kind == "tmpfs"  # a full filesystem needs a mount of its own

    def make_read_only(self) -> None:
        if self.kind == "tmpfs":
            problem = _mount("-o", "remount,ro", str(self.path))
            assert problem is None, problem
        elif self.kind == "chmod":
            self.path.chmod(0o555)
        else:
            self._fail_writes(errno.EROFS)

    def fill(self) -> int:
        """Fill the filesystem with a file of its own; returns its size."""
        if not self.really_full:
            self._fail_writes(errno.ENOSPC)
            return 0
        written = 0
        with open(self.path / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 16, 1 << 12, 1):
                try:
                    while True:
                        written += f.write(b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
        return written

    def _fail_writes(self, code: int) -> None:
        # simulated: the temporary file cannot be created, as on a read-only or full folder
        def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
            raise OSError(code, os.strerror(code))

        self.monkeypatch.setattr(disk_module.tempfile, "mkstemp", refuse)


@contextmanager
def failing_folder(path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Folder]:
    """`path` (created) as a tmpfs of `size` bytes when this process may mount, else as the fallback above."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)) is None:
        try:
            yield Folder(path, "tmpfs", monkeypatch)
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        return
    kind = "chmod" if os.geteuid() != 0 else "simulated"
    try:
        yield Folder(path, kind, monkeypatch)
    finally:
        path.chmod(0o755)
