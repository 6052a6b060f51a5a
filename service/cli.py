"""`reformer`: the one command line. Each subcommand lives in its own module and is imported lazily,
so `reformer serve` never imports training code and `reformer loadtest` never imports torch."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module", "function", "one-line help"); each function takes argv (list[str]) and
# returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("service.api.server", "main", "serve an artifact over HTTP (default: the shipped model)"),
    "train": ("train.loop", "main", "train a byte-level Reformer on text files"),
    "data": ("train.corpus_fetch", "main", "write the training corpus into corpus/ (download or --from DIR)"),
    "export": ("export.cli", "export_main", "turn a training checkpoint into a served artifact"),
    "export-stats": ("export.cli", "export_stats_main", "recompute an artifact's embedding statistics in place"),
    "export-onnx": ("export.cli", "export_onnx_main", "add a verified ONNX graph to an artifact in place"),
    "import-hf": ("export.cli", "import_hf_main", "convert a transformers Reformer checkpoint"),
    "verify": ("export.cli", "verify_main", "check an artifact's manifest, hashes and ONNX parity"),
    "loadtest": ("loadtest.cli", "main", "load-test a running server with long documents"),
}


def _usage() -> str:
    lines = ["usage: reformer <command> [options]", "", "commands:"]
    for name, (_, _, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<12} {text}")
    lines.append("")
    lines.append("`reformer <command> --help` describes each command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if args[0] in {"--version", "version"}:
        from importlib.metadata import version

        print(version("reformer-serve"))
        return 0
    name = args[0]
    if name not in SUBCOMMANDS:
        print(f"reformer: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
