"""The service at this checkout against the service at another commit: `/generate` tokens/s of the shipped
model through `reformer serve` of each, in one run on one machine (what a change to the engine, the process
settings or the model code costs or buys a user).

    python bench/serving/serve_ab.py --against REV [--artifact DIR] [--data corpus/data] [--clients 1,8]
                             [--requests 16] [--new-tokens 128] [--rounds 2] [--out bench/results/serve_ab.json]

REV is checked out with `git worktree` into a temporary folder and served by this checkout's .venv python
(`python -m service`, PYTHONPATH set to it; its C kernels build at first use, as a source checkout does). Each
server runs alone, in alternating rounds, measured as bench/serving/installed_vs_dev.py measures (closed loop, held-out
512-byte prompts, greedy, ignore_eos); both record `/info`. Both serve one artifact (REFORMER_ARTIFACT:
`--artifact`, default this checkout's shipped model), so a commit that shipped another model is compared on
the same weights. Prints a table with the load (run it through
bench/quiet_run.sh) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.serving.installed_vs_dev import Side, add_load_args, measure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="the other commit (any git revision)")
    p.add_argument("--artifact", type=Path, default=ROOT / "export" / "default_artifact",
                   help="the artifact both sides serve (default: this checkout's shipped model)")
    add_load_args(p, "serve_ab.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    command = [str(ROOT / ".venv" / "bin" / "python"), "-m", "service"]
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                       check=True, capture_output=True)
        try:
            home = Path(tmp) / "home"
            home.mkdir()
            artifact = str(args.artifact.resolve())
            sides: dict[str, Side] = {name: (command, os.environ["PATH"],
                                             {"PYTHONPATH": str(tree), "REFORMER_ARTIFACT": artifact})
                                      for name, tree in (("this tree", ROOT), (args.against, other))}
            results, infos = measure(sides, home, args)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False,
                           capture_output=True)
    load = os.getloadavg()
    rows = [{"clients": c, "this_tree_tokens_per_s": results["this tree"][c],
             "against_tokens_per_s": results[args.against][c],
             "best_ratio_this_over_against": max(results["this tree"][c]) / max(results[args.against][c])}
            for c in levels]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    report = {"command": " ".join(["python", "bench/serving/serve_ab.py", *(argv or sys.argv[1:])]), "commit": commit,
              "against": args.against, "artifact": str(args.artifact), "date": time.strftime("%Y-%m-%d"),
              "load_after": load,
              "requests_per_round": args.requests, "new_tokens": args.new_tokens, "servers": infos, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"| clients | this tree ({commit}) tokens/s | {args.against} tokens/s | this / against (best of rounds) |")
    print("|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['clients']} | {', '.join(f'{x:.0f}' for x in r['this_tree_tokens_per_s'])} | "
              f"{', '.join(f'{x:.0f}' for x in r['against_tokens_per_s'])} | "
              f"{r['best_ratio_this_over_against']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
