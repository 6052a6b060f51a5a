"""The prefix cache's disk tier (REFORMER_PREFIX_CACHE_DIR): snapshots as authenticated safetensors files named
by their key, which a restarted server, or another replica sharing the folder and its key, reads back instead
of prefilling.

A file is `<key>.safetensors` in the entry format of service/prefix_cache/entry_format.py: its metadata
carries the identity's digest, the key, when it was written, and an HMAC-SHA256 over all of it and every
tensor. A read checks the header first (identity, key, age, and the tensors' names, shapes and dtypes against
the decode cache: model/decoding/snapshot_layout.py), the file's size against what those tensors need, then
reads the bytes and checks the tag. A file that fails is refused by reason (`EntryFault`): a fault of its
content deletes it, a fault of reading it (EIO, ESTALE on a network folder) leaves it for a later read.

Writes go to a `.writing-*` temporary name in the same folder, are fsynced, renamed into place, and the folder
fsynced, so that a reader sees a whole file or none, also after a crash. The folder is kept under
`capacity_bytes`, temporary files included, by deleting the least recently used files (a hit touches its
file's modification time); temporary files older than TEMP_MAX_AGE_S (a writer that died) and entries past
the time to live are swept too."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from model.decoding.snapshot import StateSnapshot
from service.prefix_cache.entry_format import Check, EntryFault, TensorShapes, read_entry, write_entry
from service.prefix_cache.entry_key import EntryKey

log = logging.getLogger("service.prefix_cache")

SUFFIX = ".safetensors"
TEMP_PREFIX = ".writing-"
TEMP_MAX_AGE_S = 600.0  # a write takes seconds; a temporary file this old was left by a writer that died

__all__ = ["DiskTier", "EntryFault", "SUFFIX"]


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and platforms) cannot fsync a folder: the rename is still atomic
        pass
    finally:
        os.close(fd)


class DiskTier:
    def __init__(self, folder: Path, capacity_bytes: int, identity_digest: str, key: EntryKey,
                 ttl_s: float | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.identity_digest = identity_digest
        self.key = key
        self.ttl_s = ttl_s if ttl_s else None

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def write(self, key: str, snapshot: StateSnapshot) -> int:
        """Write the snapshot under `key` (unless a file is there already); returns the bytes written (0: none)."""
        target = self.path(key)
        if target.exists():
            return 0
        tensors = {name: t.detach().cpu().contiguous() for name, t in snapshot.tensors.items()}
        header = {**snapshot.header(), "identity": self.identity_digest, "key": key,
                  "written_at": json.dumps(time.time())}
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                size = write_entry(f, tensors, header, self.key.secret)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_folder(self.folder)
        try:
            self.trim()
        except OSError as exc:  # the file is written; a folder that refuses a deletion is trimmed next time
            log.warning("could not trim the prefix cache folder (%s)", exc)
        return size

    def read(self, key: str, check: Check) -> StateSnapshot | None:
        """The snapshot under `key`, None when there is no file; EntryFault when it cannot be used (the file
        deleted when the fault is its content). `check` sees the metadata and tensor shapes before any tensor is
        read (the decode cache's layout), raising ValueError."""
        target = self.path(key)
        try:
            f = open(target, "rb")  # noqa: SIM115 (closed below, after the refusal is decided)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise EntryFault("io", f"prefix cache file {target.name} could not be opened ({exc})", False) from exc
        try:
            with f:
                metadata, tensors = read_entry(f, target.name, self.key.secret, lambda m, s: self._check(m, s, key,
                                                                                                          check))
            snapshot = self._snapshot(target.name, metadata, tensors)
        except EntryFault as fault:
            if fault.content:
                try:
                    target.unlink(missing_ok=True)
                except OSError as exc:  # a read-only folder: refused all the same, under its own reason
                    log.warning("could not delete refused prefix cache file %s (%s)", target.name, exc)
            raise
        with contextlib.suppress(OSError):  # another replica may have trimmed it meanwhile
            os.utime(target)  # most recently used
        return snapshot

    def _check(self, metadata: dict[str, str], shapes: TensorShapes, key: str, check: Check) -> None:
        name = f"{key}{SUFFIX}"
        if metadata.get("identity") != self.identity_digest or metadata.get("key") != key:
            raise EntryFault("foreign", f"prefix cache file {name} was written for another artifact, setting "
                                        "or key")
        try:
            written = float(json.loads(metadata.get("written_at", "null")))
        except (TypeError, ValueError) as exc:
            raise EntryFault("corrupt", f"prefix cache file {name} has no time it was written") from exc
        if self.ttl_s is not None and not time.time() - written <= self.ttl_s:
            raise EntryFault("expired", f"prefix cache file {name} is older than its time to live")
        try:
            check(metadata, shapes)
        except ValueError as exc:
            raise EntryFault("layout", f"prefix cache file {name}: {exc}") from exc

    @staticmethod
    def _snapshot(name: str, metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> StateSnapshot:
        snapshot = StateSnapshot.from_header(metadata, tensors)
        logits = snapshot.logits
        if logits.isnan().any():  # -inf is a masked token; NaN is no distribution at all
            raise EntryFault("logits", f"prefix cache file {name} holds NaN logits")
        return snapshot

    def files(self) -> list[Path]:
        return [p for p in self.folder.glob(f"*{SUFFIX}") if not p.name.startswith(".")]

    def temp_files(self) -> list[Path]:
        return list(self.folder.glob(f"{TEMP_PREFIX}*"))

    @property
    def used_bytes(self) -> int:
        return sum(self._size(p) for p in self.files() + self.temp_files())

    @staticmethod
    def _size(p: Path) -> int:
        try:
            return p.stat().st_size
        except FileNotFoundError:  # another replica removed it meanwhile
            return 0

    def trim(self) -> int:
        """Delete stale temporary files, entries past their time to live, then least recently used entries
        until the folder, temporary files included, is within capacity; returns how many went."""
        now = time.time()
        removed = 0
        in_flight = 0
        for p in self.temp_files():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if now - st.st_mtime > TEMP_MAX_AGE_S:
                p.unlink(missing_ok=True)
                removed += 1
            else:
                in_flight += st.st_size
        entries = []
        for p in self.files():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            # mtime is at least the write time (a hit only moves it later): past the TTL, so is the entry
            if self.ttl_s is not None and now - st.st_mtime > self.ttl_s:
                p.unlink(missing_ok=True)
                removed += 1
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = in_flight + sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.capacity_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            removed += 1
        return removed
