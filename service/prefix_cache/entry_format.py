"""The disk tier's entry format: a safetensors file whose metadata carries an HMAC-SHA256 over the metadata
and every tensor (name, dtype, shape and bytes), read header first.

A file another process wrote is untrusted input. A checksum anyone can recompute proves nothing, so an entry
is authenticated with a key the replicas share (service/prefix_cache/entry_key.py): a file written without
the key, or changed after, fails the tag and is refused before its tensors are used.

Reading (`read_entry`) never loads a tensor before everything that bounds it is checked:
1. the 8-byte header length is bounded (MAX_HEADER_BYTES) and the header parsed as JSON, each tensor's
   descriptor well formed (a known dtype, a shape of non-negative integers, offsets);
2. the caller's `check` sees the metadata and each tensor's name, shape and dtype (the identity, the key, the
   decode cache's layout: model/decoding/snapshot_layout.py) before any byte of data is read;
3. the tensors must tile the data exactly and the file's size must be exactly what they need;
4. only then are the bytes read (into tensors of the checked shapes) and the tag compared in constant time.

Any fault is an `EntryFault` with a reason (the metric label) and whether it is the file's content (the
caller deletes the file) or reading it (an I/O error: the file stays, another replica may read it fine)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import BinaryIO

import torch

MAGIC = b"reformer-prefix-cache-entry/2\n"  # the tag's domain: a file of another format never verifies
MAX_HEADER_BYTES = 1 << 20  # a snapshot's header is a few KiB; a larger one is refused before it is read
TAG_FIELD = "hmac_sha256"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}

TensorShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Check = Callable[[dict[str, str], TensorShapes], None]


class EntryFault(Exception):
    """An entry that cannot be used: `reason` is the metric label; `content` whether the file itself is bad
    (deleted by the caller) rather than reading it failed (kept)."""

    def __init__(self, reason: str, message: str, content: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.content = content


def _bytes_of(t: torch.Tensor) -> memoryview:
    # the tensor's own bytes, no copy (a state may be gigabytes)
    flat = t.contiguous().reshape(-1)  # a 0-dim tensor has no byte view of its own
    return memoryview(flat.view(torch.uint8).numpy().data) if t.numel() else memoryview(b"")


def _part(h: hmac.HMAC, data: bytes | memoryview) -> None:
    # each part length-prefixed, so no two different entries give the same byte stream
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def tag(key: bytes, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """The HMAC-SHA256 of an entry: its metadata (but the tag) and each tensor, by name."""
    h = hmac.new(key, MAGIC, hashlib.sha256)
    fields = {k: v for k, v in metadata.items() if k != TAG_FIELD}
    _part(h, json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        _part(h, json.dumps([name, NAMES[t.dtype], list(t.shape)], separators=(",", ":")).encode())
        _part(h, _bytes_of(t))
    return h.hexdigest()


def write_entry(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], key: bytes) -> int:
    """Write an authenticated entry to the open file `f`; returns its size in bytes. The tensors must be on the
    CPU and contiguous."""
    names = sorted(tensors)
    header: dict[str, object] = {}
    offset = 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {**metadata, TAG_FIELD: tag(key, metadata, tensors)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in names:
        f.write(_bytes_of(tensors[name]))
    return 8 + len(raw) + offset


def _descriptors(raw: bytes, name: str) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                   dict[str, tuple[int, int]]]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise EntryFault("corrupt", f"prefix cache file {name}: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise EntryFault("corrupt", f"prefix cache file {name}: its header is not an object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise EntryFault("corrupt", f"prefix cache file {name}: no metadata of strings")
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for tensor, d in header.items():
        ok = (isinstance(d, dict) and d.get("dtype") in DTYPES and isinstance(d.get("shape"), list)
              and len(d["shape"]) <= 8 and all(type(n) is int and 0 <= n < 2**40 for n in d["shape"])
              and isinstance(d.get("data_offsets"), list) and len(d["data_offsets"]) == 2
              and all(type(n) is int and n >= 0 for n in d["data_offsets"]))
        if not ok:
            raise EntryFault("corrupt", f"prefix cache file {name}: tensor {tensor[:64]!r} has a bad descriptor")
        shapes[tensor] = (tuple(d["shape"]), DTYPES[d["dtype"]])
        spans[tensor] = (d["data_offsets"][0], d["data_offsets"][1])
    return metadata, shapes, spans


def read_entry(f: BinaryIO, name: str, key: bytes, check: Check) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of the entry in the open file `f` (`name` for messages), after every check in
    the module docstring; EntryFault otherwise (OSError from reading is passed on as an I/O fault)."""
    try:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise EntryFault("corrupt", f"prefix cache file {name} is {size} bytes: shorter than a header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise EntryFault("corrupt", f"prefix cache file {name}: header length {header_len} does not fit")
        metadata, shapes, spans = _descriptors(f.read(header_len), name)
        if TAG_FIELD not in metadata:
            raise EntryFault("unauthenticated", f"prefix cache file {name} carries no tag")
        check(metadata, shapes)
        data_start, offset = 8 + header_len, 0
        for tensor in sorted(spans, key=lambda t: spans[t]):
            shape, dtype = shapes[tensor]
            begin, end = spans[tensor]
            if begin != offset or end - begin != math.prod(shape) * dtype.itemsize:
                raise EntryFault("corrupt", f"prefix cache file {name}: tensor {tensor} is not where its "
                                            "shape puts it")
            offset = end
        if data_start + offset != size:
            raise EntryFault("corrupt", f"prefix cache file {name} is {size} bytes; its tensors need "
                                        f"{data_start + offset}")
        tensors: dict[str, torch.Tensor] = {}
        for tensor in sorted(spans, key=lambda t: spans[t]):
            shape, dtype = shapes[tensor]
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                view = _bytes_of(t)
                if f.readinto(view) != len(view):  # type: ignore[attr-defined]
                    raise EntryFault("io", f"prefix cache file {name} ended while being read", content=False)
            tensors[tensor] = t
    except OSError as exc:
        raise EntryFault("io", f"prefix cache file {name} could not be read ({exc})", content=False) from exc
    if not hmac.compare_digest(metadata[TAG_FIELD], tag(key, metadata, tensors)):
        raise EntryFault("unauthenticated", f"prefix cache file {name} fails its HMAC: written without this "
                                            "server's key, or changed since")
    return metadata, tensors

