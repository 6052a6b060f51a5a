"""`reformer export`, `reformer export-stats`, `reformer export-onnx`, `reformer import-hf` and `reformer verify`:
each takes argv and returns an exit code."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from model import ByteTokenizer, ReformerLM

from .artifact import (
    DEFAULT_ARTIFACT,
    ArtifactError,
    check_shapes,
    code_version,
    file_sha256,
    load_artifact,
    replace_embedding_stats,
    save_artifact,
)
from .checkpoint import CheckpointError, checkpoint_weights_path, read_checkpoint_weights
from .embedding_stats import (
    DEFAULT_PASSAGE_BYTES,
    DEFAULT_PASSAGES,
    SHRINKAGE_GRID,
    STATS_FILE,
    stats_for_export,
)
from .onnx_export import ExportError

log = logging.getLogger("export")


def _command(prog: str, argv: list[str]) -> str:
    return " ".join([prog, shlex.join(argv)])


def _fail(prog: str, message: object) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def _stats_line(stats: dict[str, Any]) -> str:
    if "skipped" in stats:
        return f"  embedding stats skipped: {stats['skipped']}"
    shrinkage = stats.get("whitening_shrinkage")
    what = f"mean, std and whitening matrix (shrinkage {shrinkage})" if shrinkage is not None else "mean and std"
    line = f"  embedding stats: {what} from {stats['passages']} training passages of {stats['passage_bytes']} bytes"
    scores = (stats.get("shrinkage_selection") or {}).get("held_out_accuracy")
    if isinstance(scores, dict):
        line += ("; held-out training-passage accuracy by shrinkage: "
                 + ", ".join(f"{s} {'singular' if a is None else a}" for s, a in scores.items()))
    return line


_SHRINKAGE_HELP = ("covariance shrinkage of the whitening matrix, in [0, 1]; default: chosen among "
                   f"{', '.join(f'{s:g}' for s in SHRINKAGE_GRID)} on the training passages alone (the last fifth of "
                   "each document's held out, nearest-neighbour document accuracy; export/embedding_stats.py)")


def hashing_lines(parity: dict[str, Any]) -> list[str]:
    """The tie-aware check's findings (export/onnx_ties.py): a summary of the cases that hash, then one line
    per near-tie flip, with what the flip did to that case's output."""
    cases = parity.get("hashing_cases", [])
    if not cases:
        return []
    lines = [f"  ONNX hash decisions: {sum(c['decisions'] for c in cases):,} in {len(cases)} cases that hash, "
             f"{parity['near_tie_flips']} near-tie flips (margin <= {parity['tie_margin']}); with torch's buckets "
             f"fed, logits within {parity['fed_max_abs_diff_logits']:.3g}"]
    for case in cases:
        whole = case["whole_input"]
        for flip in case["near_tie_flips"]:
            lines.append(f"  near-tie flip at {case['length']} tokens: layer {flip['layer']} round {flip['round']} "
                         f"head {flip['head']} row {flip['row']} position {flip['position']}, margin "
                         f"{flip['margin']:.2g}; the graph's own output: mean log-likelihood "
                         f"{whole['nll_relative_diff']:.2g} relative, largest logit {whole['max_abs_diff_logits']:.3g}")
    return lines


def _summary(path: Path, manifest: dict[str, Any]) -> str:
    lines = [f"artifact written to {path}"]
    onnx = manifest.get("export", {}).get("onnx")
    if onnx:
        parity = onnx.get("parity", {})
        lines.append(f"  ONNX (opset {onnx['opset']}): max abs diff vs torch {onnx['max_abs_diff']:.3g} on inputs "
                     "that do not hash")
        lines += hashing_lines(parity)
        verification = onnx.get("verification", {})
        if verification.get("scope") == "reduced":
            lines.append(f"  ONNX verification reduced: {verification['why']}")
    stats = manifest.get("export", {}).get("embedding_stats")
    if stats:
        lines.append(_stats_line(stats))
    int8 = manifest.get("evaluation", {}).get("int8")
    if int8:
        lines.append(f"  int8: {int8['bits_per_byte_fp32']:.4f} -> {int8['bits_per_byte_int8']:.4f} bits per byte"
                     f" ({int8['bits_per_byte_change']:+.4f})")
    return "\n".join(lines)


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["int8"], help="also write a dynamically quantised model.int8.onnx")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX graph (torch backend only)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reformer export", description=(
        "Turn a training checkpoint (a directory with model.safetensors whose metadata holds the config) "
        "into a served artifact: config, weights, tokenizer, manifest and a verified ONNX graph."))
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (or its model.safetensors)")
    p.add_argument("out_dir", type=Path, help="artifact directory to write")
    _add_output_flags(p)
    p.add_argument("--eval-data", type=Path, nargs="+", action="extend",
                   help="text files or directories of *.txt whose tails are held out, for the int8 bits-per-byte "
                        "check (default: a small built-in text); several may be given")
    p.add_argument("--eval-bytes", type=int, default=32768, help="bytes taken from the end of each eval file")
    p.add_argument("--embed-stats-passages", type=int, default=DEFAULT_PASSAGES,
                   help="passages of the --eval-data files' training heads (before their validation tails) whose "
                        "mean-pooled embeddings give the mean, std and shrinkage-whitening matrix the service "
                        "whitens with (embedding_stats.safetensors); 0 skips them")
    p.add_argument("--embed-stats-shrinkage", type=float, help=_SHRINKAGE_HELP)
    p.add_argument("--embed-stats-bytes", type=int, default=DEFAULT_PASSAGE_BYTES,
                   help="length of each of those passages in bytes")
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template (as in a Hugging Face tokenizer_config.json's chat_template), stored "
                        "as chat_template.jinja: /v1/chat/completions renders messages with it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quantize and args.no_onnx:
        return _fail(p.prog, "--quantize int8 quantises the ONNX graph; it cannot be combined with --no-onnx")
    try:
        config, state, metadata = read_checkpoint_weights(args.checkpoint)
        weights = checkpoint_weights_path(args.checkpoint)
        model = ReformerLM(config)
        try:
            check_shapes(model, state)
        except ArtifactError as e:
            raise CheckpointError(f"{weights}: {str(e).split(': ', 1)[1]}") from e
        model.load_state_dict(state)
        model.eval()
        chat_template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
        tok_meta = metadata.get("tokenizer")
        tokenizer = ByteTokenizer.from_dict(tok_meta) if isinstance(tok_meta, dict) else ByteTokenizer()
        provenance = dict(metadata.get("provenance") or {}) if isinstance(metadata.get("provenance"), dict) else {}
        provenance["checkpoint"] = {"path": str(weights.resolve()), "sha256": file_sha256(weights)}
        provenance["export_command"] = _command("reformer export", argv)
        evaluation = metadata.get("evaluation") if isinstance(metadata.get("evaluation"), dict) else {}
        eval_text = None
        if args.eval_data is not None:
            from .quantize import read_eval_data

            eval_text = b"\n\n".join(read_eval_data(d, args.eval_bytes) for d in args.eval_data)
        # the training run's own split, so that no validation byte is among the statistics' passages
        val_fraction = float(provenance.get("val_fraction", 0.05))
        stats = stats_for_export(model, tokenizer, list(args.eval_data) if args.eval_data else None,
                                 val_fraction, args.embed_stats_bytes, args.embed_stats_passages,
                                 args.embed_stats_shrinkage)
        out = save_artifact(model, args.out_dir, tokenizer=tokenizer, provenance=provenance, evaluation=evaluation,
                            onnx=not args.no_onnx, quantize=args.quantize, eval_text=eval_text,
                            overwrite=args.force, embedding_stats=stats, chat_template=chat_template)
    except (CheckpointError, ExportError, FileExistsError, FileNotFoundError, ValueError) as e:
        return _fail(p.prog, e)
    print(_summary(out, json.loads((out / "manifest.json").read_text())))
    return 0


def export_stats_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reformer export-stats", description=(
        "Recompute an existing artifact's embedding statistics (embedding_stats.safetensors: mean, std and the "
        "shrinkage-whitening matrix, its shrinkage chosen on training passages alone unless given) from the "
        "artifact's own model, without its training checkpoint, exactly as `reformer export` computes them; the "
        "manifest's file hash and export.embedding_stats record are updated, everything else is kept."))
    p.add_argument("artifact", type=Path, help="artifact directory to update in place")
    p.add_argument("--data", type=Path, action="append", required=True,
                   help="training text file or directory of *.txt (repeatable); passages come from each "
                        "document's training head, split with the artifact's recorded val_fraction")
    p.add_argument("--passages", type=int, default=DEFAULT_PASSAGES, help="training passages to estimate on")
    p.add_argument("--passage-bytes", type=int, default=DEFAULT_PASSAGE_BYTES, help="length of each passage")
    p.add_argument("--shrinkage", type=float, help=_SHRINKAGE_HELP)
    args = p.parse_args(argv)
    if args.passages < 2:
        return _fail(p.prog, f"--passages must be at least 2, got {args.passages}")
    try:
        art = load_artifact(args.artifact)
        # the training run's own split, as export uses it, so no validation byte is among the passages
        val_fraction = float(art.manifest.get("provenance", {}).get("val_fraction", 0.05))
        stats, record = stats_for_export(art.model, art.tokenizer, list(args.data), val_fraction,
                                         args.passage_bytes, args.passages, args.shrinkage)
        if stats is None:
            return _fail(p.prog, record.get("skipped", "no statistics computed"))
        record["refreshed"] = {"command": _command("reformer export-stats", argv), "code_version": code_version()}
        manifest = replace_embedding_stats(args.artifact, stats, record)
    except (ArtifactError, FileNotFoundError, ValueError) as e:
        return _fail(p.prog, e)
    entry = manifest["files"][STATS_FILE]
    print(f"{STATS_FILE} rewritten in {args.artifact} ({entry['size']} bytes, sha256 {entry['sha256'][:16]}); "
          "manifest updated, artifact checks out")
    print(_stats_line(record))
    return 0


def export_onnx_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reformer export-onnx", description=(
        "Add a verified ONNX graph (and with --quantize int8 its int8 graph) to an existing artifact, made from "
        "the artifact's own model; weights, tokenizer and statistics are kept byte for byte, the manifest "
        "gains the graphs' hashes and export records."))
    p.add_argument("artifact", type=Path, help="artifact directory to update in place")
    p.add_argument("--quantize", choices=["int8"], help="also write a dynamically quantised model.int8.onnx")
    p.add_argument("--eval-data", type=Path, nargs="+", action="extend",
                   help="text files or directories of *.txt whose tails are held out, for the int8 bits-per-byte "
                        "check (default: a small built-in text); several may be given")
    p.add_argument("--eval-bytes", type=int, default=32768, help="bytes taken from the end of each eval file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .onnx_add import add_onnx_graphs
    from .quantize import read_eval_data

    try:
        eval_text = None if args.eval_data is None else \
            b"\n\n".join(read_eval_data(d, args.eval_bytes) for d in args.eval_data)
        manifest = add_onnx_graphs(args.artifact, args.quantize == "int8", eval_text,
                                   _command("reformer export-onnx", argv))
    except (ArtifactError, ExportError, FileNotFoundError, ValueError) as e:
        return _fail(p.prog, e)
    print(_summary(args.artifact, manifest))
    return 0


def _without_token(argv: list[str]) -> list[str]:
    """argv as the manifest records it: a --token value is a secret."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--token="):
            out[i] = "--token=<hidden>"
        elif arg == "--token" and i + 1 < len(out):
            out[i + 1] = "<hidden>"
    return out


def import_hf_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reformer import-hf", description=(
        "Convert a transformers Reformer checkpoint (config.json plus model.safetensors or pytorch_model.bin, "
        "and its tokenizer: spiece.model or tokenizer.json; none for byte-level vocabularies) into an artifact, "
        "after checking logits parity against transformers. A hub id (owner/name) is downloaded with "
        "huggingface_hub, into its cache."))
    p.add_argument("hf_dir", help="a directory saved by transformers (save_pretrained), or a hub id such as "
                                  "google/reformer-crime-and-punishment")
    p.add_argument("out_dir", type=Path, help="artifact directory to write")
    _add_output_flags(p)
    p.add_argument("--skip-parity", action="store_true",
                   help="write the artifact without the logits check against transformers (needed when "
                        "transformers is not installed); the manifest records that parity was skipped")
    p.add_argument("--revision", help="hub id only: the branch, tag or commit to download (default: main)")
    p.add_argument("--cache-dir", type=Path, help="hub id only: huggingface_hub's cache directory (default: "
                                                  "HF_HUB_CACHE, or HF_HOME/hub)")
    p.add_argument("--token", help="hub id only: a hub access token (default: HF_TOKEN, or the saved login)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .hf_import import HFImportError, import_hf

    try:
        out, parity = import_hf(args.hf_dir, args.out_dir, onnx=not args.no_onnx, quantize=args.quantize,
                                overwrite=args.force, command=_command("reformer import-hf", _without_token(argv)),
                                skip_parity=args.skip_parity, revision=args.revision, cache_dir=args.cache_dir,
                                token=args.token)
    except (HFImportError, ExportError, FileExistsError, ValueError) as e:
        return _fail(p.prog, e)
    if parity["checked"]:
        print(f"logits parity with transformers: max abs diff {parity['max_abs_diff']:.3g} at lengths "
              f"{parity['lengths']}")
    else:
        print(f"logits parity with transformers NOT checked: {parity['reason']}", file=sys.stderr)
    print(_summary(out, json.loads((out / "manifest.json").read_text())))
    return 0


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reformer verify", description=(
        "Check an artifact: manifest format, every file's size and sha256, config against weight shapes, "
        "and (when it has one) the ONNX graph's structure and its parity with torch on fresh random inputs."))
    p.add_argument("artifact", type=Path, nargs="?", default=DEFAULT_ARTIFACT,
                   help="artifact directory (default: the shipped default artifact)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fresh random inputs for the ONNX check")
    args = p.parse_args(argv)
    try:
        art = load_artifact(args.artifact)
    except ArtifactError as e:
        return _fail(p.prog, e)
    print(f"{art.path}: manifest and {len(art.manifest['files'])} files check out; "
          f"{art.model.num_parameters():,} parameters; weights sha256 {art.sha256[:16]}")
    stats = art.embedding_stats
    if stats is not None:
        dim = stats.mean.numel()
        print(f"{STATS_FILE}: mean and std of {dim} dimensions, finite, std > 0; "
              + (f"whitening matrix {dim} x {dim}, finite: mean-pooled embeddings are whitened"
                 if stats.whitening is not None else
                 "no whitening matrix (older file): mean-pooled embeddings are standardised per dimension"))
    if art.onnx_path is None:
        print("no ONNX graph in this artifact")
        return 0
    from .onnx_budget import plan_verification
    from .onnx_export import check_graph, ort_session, run_ort, verification_cases, verify_onnx

    try:
        info = check_graph(art.onnx_path)
        # a large model on the cases its size affords, as at export (export/onnx_budget.py)
        plan = plan_verification(art.model, seed=args.seed)
        parity = verify_onnx(art.model, art.onnx_path, seed=args.seed, cases=plan.cases)
    except ExportError as e:
        return _fail(p.prog, e)
    print(f"{art.onnx_path.name}: opset {info['opset']}, no random operators, dynamic batch and length; "
          f"max abs diff vs torch {parity['max_abs_diff_logits']:.3g} on inputs that do not hash "
          f"(tolerance {parity['tolerance']})")
    for line in hashing_lines(parity):
        print(line.strip())
    if art.onnx_int8_path is not None:
        # int8 is approximate by design: checked for structure and that it runs; its quality cost is the
        # bits-per-byte change recorded at export
        try:
            check_graph(art.onnx_int8_path)
            ids, mask = (plan.cases or verification_cases(art.model, seed=args.seed))[-1]
            logits, _ = run_ort(ort_session(art.onnx_int8_path), ids, mask)
        except ExportError as e:
            return _fail(p.prog, e)
        change = art.manifest.get("evaluation", {}).get("int8", {}).get("bits_per_byte_change")
        recorded = f"{change:+.4f}" if change is not None else "none recorded"
        print(f"{art.onnx_int8_path.name}: runs, logits {tuple(logits.shape)}; bits-per-byte change {recorded}")
    return 0
