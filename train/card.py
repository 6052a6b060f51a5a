"""The model card's training sections written from what a run recorded: the data files (folder, bytes, full
sha256), the command, and the long-range recipe's options and stages, read from a training checkpoint's
metadata or an exported artifact's manifest (the same provenance, carried over by `reformer export`).

    python -m train.card runs/NAME/checkpoint        (or an artifact directory) > section.md

docs/MODEL_CARD.md is written by hand around these sections; generating them keeps its tables equal to
what was trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def read_provenance(path: Path) -> dict[str, Any]:
    manifest = path / "manifest.json"
    if manifest.exists():
        return dict(json.loads(manifest.read_text()).get("provenance") or {})
    from .checkpoint import read_checkpoint_metadata

    return dict(read_checkpoint_metadata(path).get("provenance") or {})


def data_section(prov: dict[str, Any]) -> str:
    files = prov.get("data_files") or []
    lines = ["## Training data", "",
             f"{len(files)} files, read in place (never copied into the repository); each file's last "
             f"{prov.get('val_fraction', 0.05):.0%} held out for validation.", "",
             "| folder | file | bytes | sha256 |", "|---|---|---:|---|"]
    lines += [f"| {f.get('folder', '')} | `{f['name']}` | {f['bytes']:,} | `{f['sha256']}` |" for f in files]
    corpus = prov.get("corpus")
    if corpus and (corpus.get("files") or corpus.get("exclude_files")):
        lines += ["", f"Selected with --files {','.join(corpus['files']) or '-'} and --exclude-files "
                      f"{','.join(corpus['exclude_files']) or '-'}."]
    return "\n".join(lines)


def _passage(recipe: dict[str, Any]) -> str:
    """'140-byte passage', or '24-160-byte passage, 50% random bytes' for a recipe that draws lengths."""
    lo, hi = recipe.get("copy_passage_min", recipe["copy_passage"]), recipe["copy_passage"]
    text = f"{hi if lo == hi else f'{lo}-{hi}'}-byte passage"
    return text + (f", {recipe['copy_random']:.0%} random bytes" if "copy_random" in recipe else "")


def recipe_section(prov: dict[str, Any]) -> str:
    recipe = prov.get("recipe")
    lines = ["## Training procedure", "", "```", str(prov.get("command", "")), "```", ""]
    if not recipe:
        return "\n".join([*lines, "Plain next-byte prediction on prose windows (no long-range recipe)."])
    mix = recipe["mix"]
    lines += [f"Long-range recipe (train/recipe.py): windows {mix['passkey']:.0%} passkey documents, "
              f"{mix['copy']:.0%} copy documents ({_passage(recipe)}, {recipe['copy_cue']}-byte "
              f"cue), {mix['prose']:.0%} prose; loss = {recipe['prose_weight']} x mean over all bytes + "
              f"{recipe['answer_weight']} x mean over the answer bytes; early advance at "
              f"{recipe['advance_at'] or 'off'}.", "",
              "| stage | window | batch | largest gap | until step |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {i} | {s['window']:,} | {s['batch_size']} | {s['gap']:,} | {s['until'] or 'end'} |"
              for i, s in enumerate(recipe["stages"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m train.card CHECKPOINT_OR_ARTIFACT", file=sys.stderr)
        return 2
    prov = read_provenance(Path(args[0]))
    print(data_section(prov) + "\n\n" + recipe_section(prov))
    return 0


if __name__ == "__main__":
    sys.exit(main())
