"""Validation curves of `reformer train` runs: bits per byte against tokens seen and against wall time,
one line per run, from each run's curve.csv (written by the trainer at every validation).

    python bench/training/plot_training.py RUN_DIR [RUN_DIR ...] [--out bench/results/training_curves.png]
                                  [--labels NAME,...] [--target 2.2] [--chain]

The last point of a run is its final validation (all held-out tails); the others use the periodic
subset (`--val-windows`), so the last point can sit a little off the line. `--chain`: each run continued
the one before it (`reformer train --init-from`), so its tokens and wall time are counted on from where
that run ended."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def read_curve(run: Path) -> list[dict[str, float]]:
    path = run / "curve.csv" if run.is_dir() else run
    if not path.exists():
        raise FileNotFoundError(f"{path}: no curve.csv (is {run} a `reformer train --out` directory?)")
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def chained(runs: list[tuple[str, list[dict[str, float]]]]) -> list[tuple[str, list[dict[str, float]]]]:
    """Each run's tokens seen and wall time counted on from the end of the run before it."""
    out, tokens, wall = [], 0.0, 0.0
    for label, rows in runs:
        out.append((label, [{**r, "tokens_seen": r["tokens_seen"] + tokens, "wall_time_s": r["wall_time_s"] + wall}
                            for r in rows]))
        if rows:
            tokens, wall = out[-1][1][-1]["tokens_seen"], out[-1][1][-1]["wall_time_s"]
    return out


def plot(runs: list[tuple[str, list[dict[str, float]]]], out: Path, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    retrieval = any("val_passkey_acc" in r for _, rows in runs for r in rows)
    if retrieval:  # the long-range recipe's columns (train/recipe_run.py): a second row of panels
        fig, grid = plt.subplots(2, 2, figsize=(11, 8.0))
        axes, lower = grid[0], grid[1]
        axes[1].sharey(axes[0])
    else:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, rows in runs:
        tokens = [r["tokens_seen"] / 1e6 for r in rows]
        wall = [r["wall_time_s"] / 60 for r in rows]
        bpb = [r["val_bpb"] for r in rows]
        axes[0].plot(tokens, bpb, marker=".", label=label)
        axes[1].plot(wall, bpb, marker=".", label=label)
        # phase boundaries: where the phase index changes
        for a, b in zip(rows, rows[1:]):
            if b.get("phase", 0) != a.get("phase", 0):
                axes[1].axvline(b["wall_time_s"] / 60, color="grey", lw=0.6, ls=":")
    axes[0].set_xlabel("tokens (bytes) seen, millions")
    axes[1].set_xlabel("wall time, minutes")
    axes[0].set_ylabel("validation bits per byte")
    for ax in axes:
        if target is not None:
            ax.axhline(target, color="red", lw=0.8, ls="--", label=f"target {target}")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    if retrieval:
        _plot_retrieval(runs, lower)
    fig.suptitle("reformer train: validation bits per byte" + (" and retrieval" if retrieval else ""))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def _plot_retrieval(runs: list[tuple[str, list[dict[str, float]]]], axes: Any) -> None:
    """Passkey answer loss (training, held-out) and held-out exact accuracy against tokens seen."""
    for label, rows in runs:
        for key, style in (("train_passkey_loss", "-"), ("val_passkey_loss", "--")):
            pts = [(r["tokens_seen"] / 1e6, r[key]) for r in rows if key in r]
            if pts:
                axes[0].plot(*zip(*pts), ls=style, marker=".", label=f"{label}: {key.split('_')[0]}")
        pts = [(r["tokens_seen"] / 1e6, r["val_passkey_acc"]) for r in rows if "val_passkey_acc" in r]
        if pts:
            axes[1].plot(*zip(*pts), marker=".", label=label)
    axes[0].axhline(2.302585, color="grey", lw=0.8, ls=":", label="chance (ln 10)")
    axes[0].set_ylabel("passkey answer loss, nats a digit")
    axes[1].set_ylabel("held-out passkey exact (at the stage's window)")
    for ax in axes:
        ax.set_xlabel("tokens (bytes) seen, millions")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (or curve.csv files)")
    p.add_argument("--labels", help="comma-separated names, one per run (default: directory names)")
    p.add_argument("--target", type=float, default=2.2, help="horizontal target line (bits per byte)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "training_curves.png")
    p.add_argument("--chain", action="store_true", help="each run fine-tunes the one before: count on from its end")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [r.name if r.is_dir() else r.parent.name for r in args.runs]
    if len(labels) != len(args.runs):
        print("plot_training: --labels needs one name per run", file=sys.stderr)
        return 2
    try:
        runs = [(label, read_curve(r)) for label, r in zip(labels, args.runs)]
    except FileNotFoundError as e:
        print(f"plot_training: {e}", file=sys.stderr)
        return 2
    if args.chain:
        runs = chained(runs)
    plot(runs, args.out, args.target)
    for label, rows in runs:
        last = rows[-1] if rows else {}
        print(f"{label}: {len(rows)} validations; last {last.get('val_bpb', float('nan')):.4f} bits per byte after "
              f"{last.get('tokens_seen', 0):,.0f} tokens, {last.get('wall_time_s', 0):.0f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
