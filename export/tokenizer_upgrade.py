"""Rewrites an older artifact's tokenizer files in the current layout: its tokenizer.json, which held the byte
tokenizer's description, becomes a `tokenizers` file and the description moves to reformer_tokenizer.json. The
manifest's entries for those files are replaced; every other entry (weights, graphs, provenance, evaluation)
stays as it was. `python -m export.tokenizer_upgrade DIR`."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from model.tokenizers.files import HF_FILE, is_legacy_description, write_tokenizer_files

from .artifact import MANIFEST_FILE, file_entry, load_artifact, manifest_text


def upgrade_tokenizer_files(directory: str | Path) -> bool:
    """True if the files were rewritten, False if the artifact already has the current layout. The artifact
    must load (hashes included) before, so nothing unverified is re-signed, and does after."""
    directory = Path(directory)
    art = load_artifact(directory)
    if not is_legacy_description(json.loads((directory / HF_FILE).read_text())):
        return False
    manifest = dict(art.manifest)
    files = dict(manifest["files"])
    with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
        staged = Path(tmp)
        names = write_tokenizer_files(art.tokenizer, staged)
        for name in names:
            files[name] = file_entry(staged / name)
        manifest["files"] = files
        (staged / MANIFEST_FILE).write_text(manifest_text(manifest))
        umask = os.umask(0)
        os.umask(umask)
        for name in [*names, MANIFEST_FILE]:  # the manifest last: until then the old one still vouches
            (staged / name).chmod(0o644 & ~umask)
            os.replace(staged / name, directory / name)
    if load_artifact(directory).tokenizer != art.tokenizer:
        raise RuntimeError(f"{directory}: the rewritten tokenizer files read back as a different tokenizer")
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m export.tokenizer_upgrade ARTIFACT_DIR", file=sys.stderr)
        return 2
    print("rewritten" if upgrade_tokenizer_files(args[0]) else "already in the current layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
