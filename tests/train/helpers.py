"""What the model-option tests (--successor-heads, --key-conv) share: a tiny model's flags and a one-file corpus."""

from __future__ import annotations

from pathlib import Path

TINY = ["--hidden-size", "32", "--num-heads", "2", "--attn-layers", "local,lsh", "--feed-forward-size", "64",
        "--chunk-length", "16", "--num-buckets", "4", "--axial-pos-shape", "16,64", "--max-positions", "1024",
        "--warmup-steps", "1", "--threads", "1", "--val-windows", "1", "--no-progress", "--window", "64",
        "--batch-size", "2", "--eval-every", "0"]


def repeated_corpus(tmp_path: Path) -> Path:
    """A folder with one file of one repeated sentence."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(["the king said to the queen"] * 200) + "\n")
    return corpus
