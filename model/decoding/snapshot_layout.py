"""Whether a snapshot described by a file (its scalar header and each tensor's name, shape and dtype) is one
this decode cache could have taken (model/decoding/snapshot.py `take_snapshot`), checked before any tensor's
bytes are read: a reader that trusts a file's shapes or counts would index out of range in `restore_snapshot`
or in a later step, or stack logits of the wrong length with another request's.

What is checked: the header's scalar fields (length, per-layer bucket counts and index lengths, the bucket
count hashed ahead) are well formed and within this cache's bounds; the set of tensor names is exactly the
one a snapshot of this cache at that header holds; every tensor's shape and dtype is the one that snapshot
has; the logits are (vocab,) float32. What is not: the values inside the tensors (a file is trusted that far
only because its writer held the key: service/prefix_cache/entry_format.py)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from .cache import DecodeCache
from .snapshot import PREFIX_BLOCK

TensorShapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_AHEAD = re.compile(r"ahead\.(\d{1,4})\.(\d{1,6})")


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # bool is not a count
        raise ValueError(f"{what} must be an integer in [{low}, {high}]; got {value!r}")
    return value


def _bucket_count(value: Any, what: str, limit: int) -> int:
    """A bucket count (an int, or a list of factors) as its flat product, within `limit`."""
    if isinstance(value, list):
        if not 1 <= len(value) <= 8:
            raise ValueError(f"{what} must have 1 to 8 factors")
        flat = math.prod(_int(v, what, 1, limit) for v in value)
    else:
        flat = _int(value, what, 1, limit)
    if flat > limit:
        raise ValueError(f"{what} {flat} exceeds this cache's {limit}")
    return flat


def parse_header(cache: DecodeCache, header: Mapping[str, str]) -> dict[str, Any]:
    """The header's scalar fields decoded and bounded (ValueError naming the field otherwise)."""
    try:
        fields = {name: json.loads(header[name]) for name in ("length", "num_buckets", "index_len", "ahead", "meta")}
    except KeyError as exc:
        raise ValueError(f"header field {exc} is missing") from exc
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"a header field is not JSON ({exc})") from exc
    layers = len(cache.indexes)
    length = _int(fields["length"], "length", 1, cache.max_tokens)
    num_buckets, index_len = fields["num_buckets"], fields["index_len"]
    if not isinstance(num_buckets, list) or len(num_buckets) != layers:
        raise ValueError(f"num_buckets must list this cache's {layers} layers")
    if not isinstance(index_len, list) or len(index_len) != layers:
        raise ValueError(f"index_len must list this cache's {layers} layers")
    for li, (nb, n) in enumerate(zip(num_buckets, index_len)):
        _int(n, f"index_len[{li}]", 0, length)
        if nb is not None:
            if cache.indexes[li] is None:
                raise ValueError(f"num_buckets[{li}] is set for a local layer")
            _bucket_count(nb, f"num_buckets[{li}]", cache.bucket_limits[li])
    ahead = fields["ahead"]
    if ahead is not None:
        _bucket_count(ahead, "ahead", max(cache.bucket_limits, default=0))
    if not isinstance(fields["meta"], dict):
        raise ValueError("meta must be an object")
    fields["tails"] = _tails(cache, header.get("tails", "{}"), length)
    return fields


def _tails(cache: DecodeCache, text: str, length: int) -> dict[int, bool]:
    """The boundaries the snapshot kept tails at (model/decoding/prefix_restore.py) -> whether buckets were
    hashed ahead there, each boundary a multiple of PREFIX_BLOCK within the state, its counts bounded."""
    try:
        tails = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"header field 'tails' is not JSON ({exc})") from exc
    if not isinstance(tails, dict) or len(tails) > length // PREFIX_BLOCK:
        raise ValueError("tails must be an object with at most one entry per block")
    out: dict[int, bool] = {}
    for name, facts in tails.items():
        b = int(name) if isinstance(name, str) and name.isdigit() and len(name) <= 9 else -1
        if b <= 0 or b % PREFIX_BLOCK or b > length:
            raise ValueError(f"tail boundary {name!r} is not a multiple of {PREFIX_BLOCK} within the state")
        if not (isinstance(facts, list) and len(facts) == 2 and isinstance(facts[1], bool)
                and isinstance(facts[0], list) and len(facts[0]) == len(cache.indexes)):
            raise ValueError(f"tail {b}'s facts must be [num_buckets per layer, ahead]")
        for li, nb in enumerate(facts[0]):
            if nb is not None:
                if cache.indexes[li] is None:
                    raise ValueError(f"tail {b}'s num_buckets[{li}] is set for a local layer")
                _bucket_count(nb, f"tail {b}'s num_buckets[{li}]", cache.bucket_limits[li])
        out[b] = facts[1]
    return out


def check_layout(cache: DecodeCache, header: Mapping[str, str], tensors: TensorShapes, vocab: int) -> None:
    """ValueError naming the first difference between the file's tensors and what a snapshot of this cache at
    `header` holds (see the module docstring)."""
    fields = parse_header(cache, header)
    length, index_len = fields["length"], fields["index_len"]
    want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"logits": ((vocab,), torch.float32)}
    for li, index in enumerate(cache.indexes):
        if index is None:
            ring = cache.kv[li][: cache.ring.width]
            want[f"ring.{li}"] = (tuple(ring.shape), ring.dtype)
            continue
        norms = cache.norms[li]
        assert norms is not None
        want[f"kv.{li}"] = ((length, *cache.kv[li].shape[1:]), cache.kv[li].dtype)
        want[f"norms.{li}"] = ((length, *norms.shape[1:]), norms.dtype)
        want[f"order.{li}"] = ((index_len[li], *index.order.shape[1:]), index.order.dtype)
        want[f"recent.{li}"] = (tuple(index.recent.shape[1:]), index.recent.dtype)
        # the counts' width is the cache-wide bucket count when the snapshot was taken: any up to the limit
        counts = tensors.get(f"main_counts.{li}")
        width = counts[0][-1] if counts is not None and len(counts[0]) == 3 else -1
        _int(width, f"main_counts.{li}'s bucket width", 1, cache.bucket_limits[li])
        for name, pool in (("main_counts", index.main_counts), ("recent_counts", index.recent_counts)):
            want[f"{name}.{li}"] = ((*pool.shape[1:3], width), pool.dtype)
    for b, ahead_at in fields["tails"].items():
        if f"tail.{b}.logits" in tensors:
            want[f"tail.{b}.logits"] = ((vocab,), torch.float32)
        if not ahead_at:  # a tail where buckets were hashed ahead keeps no rings (it is never restored)
            for li, index in enumerate(cache.indexes):
                if index is None:
                    ring = cache.kv[li][: cache.ring.width]
                    want[f"tail.{b}.ring.{li}"] = (tuple(ring.shape), ring.dtype)
    ahead = [name for name in tensors if name.startswith("ahead.")]
    if ahead and fields["ahead"] is None:
        raise ValueError("buckets hashed ahead without the count they were hashed for")
    hashed: dict[int, list[int]] = {}
    for name in ahead:
        match = _AHEAD.fullmatch(name)
        layer = int(match.group(1)) if match else -1
        if match is None or not 0 <= layer < len(cache.indexes) or cache.indexes[layer] is None:
            raise ValueError(f"tensor {name!r} names no LSH layer of this cache")
        index = cache.indexes[layer]
        assert index is not None
        shape, dtype = tensors[name]
        if len(shape) != 3 or tuple(shape[:2]) != tuple(index.main_counts.shape[1:3]) or dtype != torch.int32:
            raise ValueError(f"tensor {name} is {tuple(shape)} {dtype}, not (heads, rounds, n) int32")
        hashed.setdefault(layer, []).append(int(match.group(2)))
        want[name] = (tuple(shape), dtype)
        if sum(tensors[f"ahead.{layer}.{i}"][0][-1] for i in hashed[layer] if f"ahead.{layer}.{i}" in tensors) \
                > length:
            raise ValueError(f"layer {layer} has more positions hashed ahead than the state holds")
    for layer, parts in hashed.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"layer {layer}'s slices hashed ahead are not numbered 0..{len(parts) - 1}")
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"tensors missing {missing[:4]}, unexpected {extra[:4]}")
    for name, (shape, dtype) in want.items():
        got_shape, got_dtype = tensors[name]
        if tuple(got_shape) != shape or got_dtype != dtype:
            raise ValueError(f"tensor {name} is {tuple(got_shape)} {got_dtype}; this cache's is {shape} {dtype}")
