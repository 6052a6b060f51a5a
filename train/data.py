"""Training data: UTF-8 text files -> cleaned documents -> byte tokens in memory-mapped files, split into
training heads and held-out validation tails, served as random (training) or fixed (validation) windows.
Finding, cleaning and cutting the documents is export/documents.py's, shared with the embedding statistics
an artifact ships (export may not import train).

Every document contributes its head to `train.bin` and its tail (the last `val_fraction` of its tokens)
to `val.bin`; windows never cross a document boundary, so no validation byte is inside a training window."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export.documents import DataError, find_text_files, read_document, split_point
from model.tokenizer import ByteTokenizer

CACHE_FORMAT = 1  # bump when cleaning or the file layout changes, so stale caches are rebuilt
_TOKEN_DTYPE = np.uint16  # ids are byte + 2 (2..257): one byte is not enough


@dataclass(frozen=True)
class SourceFile:
    path: Path
    sha256: str
    size: int


@dataclass(frozen=True)
class Segment:
    """One document's part (head or tail) inside a token file: [start, start + length)."""

    name: str
    start: int
    length: int


def describe_files(files: list[Path]) -> list[SourceFile]:
    return [SourceFile(f, hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_size) for f in files]


class TokenFile:
    """A memory-mapped token file and the document segments inside it."""

    def __init__(self, path: Path, segments: list[Segment]) -> None:
        self.path = path
        self.segments = segments
        total = sum(s.length for s in segments)
        self.tokens = (np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", shape=(total,)) if total
                       else np.zeros(0, dtype=_TOKEN_DTYPE))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def window(self, start: int, length: int) -> np.ndarray:
        return np.asarray(self.tokens[start:start + length], dtype=np.int64)


@dataclass
class Corpus:
    files: list[SourceFile]
    train: TokenFile
    val: TokenFile
    cache_dir: Path

    def provenance(self) -> list[dict[str, object]]:
        return [{"name": f.path.name, "folder": f.path.parent.name, "sha256": f.sha256, "bytes": f.size}
                for f in self.files]


def prepare_corpus(sources: list[str | Path], cache_root: Path, val_fraction: float = 0.05) -> Corpus:
    """Clean and tokenize the files once; later calls with the same files reuse the cache."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files = describe_files(find_text_files(sources))
    key = hashlib.sha256(json.dumps(
        [CACHE_FORMAT, val_fraction, [(f.path.name, f.sha256) for f in files]]).encode()).hexdigest()[:16]
    cache_dir = cache_root / key
    meta_path = cache_dir / "meta.json"
    if not meta_path.exists():
        _build_cache(files, cache_dir, val_fraction)
    meta = json.loads(meta_path.read_text())
    train = TokenFile(cache_dir / "train.bin", [Segment(**s) for s in meta["train"]])
    val = TokenFile(cache_dir / "val.bin", [Segment(**s) for s in meta["val"]])
    return Corpus(files=files, train=train, val=val, cache_dir=cache_dir)


def _build_cache(files: list[SourceFile], cache_dir: Path, val_fraction: float) -> None:
    tokenizer = ByteTokenizer()
    heads: list[tuple[str, np.ndarray]] = []
    tails: list[tuple[str, np.ndarray]] = []
    for f in files:
        ids = np.asarray(tokenizer.encode(read_document(f.path)), dtype=_TOKEN_DTYPE)
        cut = split_point(len(ids), val_fraction)
        heads.append((f.path.name, ids[:cut]))
        tails.append((f.path.name, ids[cut:]))
    if sum(len(h) for _, h in heads) == 0:
        names = ", ".join(f.path.name for f in files)
        raise DataError(f"the corpus is empty: no text left in {names} after cleaning")
    tmp = cache_dir.with_name(cache_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    meta: dict[str, list[dict[str, object]]] = {}
    for split, parts in (("train", heads), ("val", tails)):
        segments, offset = [], 0
        with open(tmp / f"{split}.bin", "wb") as out:
            for name, ids in parts:
                out.write(ids.tobytes())
                segments.append({"name": name, "start": offset, "length": int(len(ids))})
                offset += len(ids)
        meta[split] = segments
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    # rename last: a half-written cache is never mistaken for a complete one
    if cache_dir.exists():
        import shutil

        shutil.rmtree(cache_dir)
    tmp.rename(cache_dir)


class WindowSampler:
    """Random training windows of `window + 1` tokens (inputs and next-token targets).

    The windows of one optimizer step are a pure function of (seed, step, micro-step): every rank draws
    the same global batch of `batch_size * world_size` windows and keeps its own rows, so two ranks with
    batch b see exactly what one process with batch 2b sees."""

    def __init__(self, data: TokenFile, window: int, seed: int) -> None:
        self.data = data
        self.window = window
        self.seed = seed
        usable = [s for s in data.segments if s.length >= window + 1]
        if not usable:
            longest = max((s.length for s in data.segments), default=0)
            raise DataError(
                f"no training document is longer than the window ({window} + 1 tokens); the longest "
                f"training part has {longest} tokens: use a shorter --window or more text"
            )
        self.segments = usable
        counts = np.array([s.length - window for s in usable], dtype=np.float64)  # valid start positions
        self.weights = counts / counts.sum()

    def rng(self, step: int, micro: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step, micro])

    def global_batch(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        picks = rng.choice(len(self.segments), size=rows, p=self.weights)
        out = np.empty((rows, self.window + 1), dtype=np.int64)
        for i, k in enumerate(picks):
            seg = self.segments[int(k)]
            start = seg.start + int(rng.integers(0, seg.length - self.window))
            out[i] = self.data.window(start, self.window + 1)
        return out


def validation_windows(data: TokenFile, window: int, max_windows: int | None = None) -> list[np.ndarray]:
    """Fixed, deterministic windows tiling every validation tail (stride `window`, each window carries one
    extra token as the last target); a tail shorter than a window gives one shorter window. With
    `max_windows`, an evenly spaced subset (same every time)."""
    windows: list[np.ndarray] = []
    for seg in data.segments:
        if seg.length < 2:
            continue
        for start in range(0, max(seg.length - 1, 1), window):
            length = min(window + 1, seg.length - start)
            if length >= 2:
                windows.append(data.window(seg.start + start, length))
    if max_windows is not None and len(windows) > max_windows:
        idx = np.linspace(0, len(windows) - 1, max_windows).round().astype(int)
        windows = [windows[i] for i in idx]
    return windows
