"""The prefix cache's disk tier (REFORMER_PREFIX_CACHE_DIR): snapshots as safetensors files named by their key,
which a restarted server, or another replica sharing the folder, reads back instead of prefilling.

A file is `<key>.safetensors`; the key (service/prefix_cache/keys.py) already chains the cache identity (the
artifact's sha256 and every bit-changing setting), so a replica never even opens another artifact's files by
name. Its metadata carries the identity's digest, the key and a CRC-32 of every tensor's bytes; a read checks
all three and the tensors' layout against the decode cache (model/decoding/snapshot.py `check_fits`), and a
file that fails any check is refused by name (`DiskRefusal`), counted, deleted, and the request prefills
instead. Writes go to a temporary name in the same folder and are renamed into place, so a reader sees a
whole file or none. The folder is kept under `capacity_bytes` by deleting the least recently used files
(a hit touches its file's modification time)."""

from __future__ import annotations

import logging
import os
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.decoding.snapshot import StateSnapshot

log = logging.getLogger("service.prefix_cache")

SUFFIX = ".safetensors"


class DiskRefusal(Exception):
    """A disk entry that cannot be used; `reason` is the metric label (corrupt, foreign, layout)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _crc(t: torch.Tensor) -> int:
    # over the tensor's own bytes (a NumPy view: no copy of a state that may be gigabytes)
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().data) if t.numel() else 0


def checksums(tensors: dict[str, torch.Tensor]) -> str:
    return ",".join(f"{name}:{_crc(tensors[name])}" for name in sorted(tensors))


class DiskTier:
    def __init__(self, folder: Path, capacity_bytes: int, identity_digest: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.identity_digest = identity_digest

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def write(self, key: str, snapshot: StateSnapshot) -> int:
        """Write the snapshot under `key` (unless a file is there already); returns the bytes written."""
        target = self.path(key)
        if target.exists():
            return 0
        tensors = {name: t.detach().cpu().contiguous() for name, t in snapshot.tensors.items()}
        header = {**snapshot.header(), "identity": self.identity_digest, "key": key, "crc32": checksums(tensors)}
        fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=SUFFIX, dir=self.folder)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=header)
            size = os.path.getsize(tmp)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.trim()
        return size

    def read(self, key: str) -> StateSnapshot | None:
        """The snapshot under `key`, None when there is no file; DiskRefusal (the file deleted) when it is
        corrupt or belongs to another identity or key."""
        target = self.path(key)
        if not target.is_file():
            return None
        try:
            snapshot = self._load(target, key)
        except DiskRefusal:
            target.unlink(missing_ok=True)
            raise
        os.utime(target)  # most recently used
        return snapshot

    def _load(self, target: Path, key: str) -> StateSnapshot:
        try:
            with safe_open(str(target), "pt") as f:
                header = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise DiskRefusal("corrupt", f"prefix cache file {target.name} is not a readable safetensors file "
                                         f"({exc})") from exc
        if header.get("identity") != self.identity_digest or header.get("key") != key:
            raise DiskRefusal("foreign", f"prefix cache file {target.name} was written for another artifact, "
                                         "setting or key")
        if header.get("crc32") != checksums(tensors):
            raise DiskRefusal("corrupt", f"prefix cache file {target.name} fails its checksum")
        try:
            return StateSnapshot.from_header(header, tensors)
        except (KeyError, ValueError, TypeError) as exc:
            raise DiskRefusal("corrupt", f"prefix cache file {target.name} has a bad header ({exc})") from exc

    def files(self) -> list[Path]:
        return [p for p in self.folder.glob(f"*{SUFFIX}") if not p.name.startswith(".")]

    @property
    def used_bytes(self) -> int:
        return sum(self._size(p) for p in self.files())

    @staticmethod
    def _size(p: Path) -> int:
        try:
            return p.stat().st_size
        except FileNotFoundError:  # another replica removed it meanwhile
            return 0

    def trim(self) -> int:
        """Delete least recently used files until the folder is within capacity; returns how many went."""
        entries = []
        for p in self.files():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, p in sorted(entries):
            if total <= self.capacity_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed
