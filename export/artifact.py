"""The served artifact: a directory with config, weights, tokenizer, optional ONNX graphs and a manifest
that records every file's sha256 and size. Loading checks all of it before building the model: it reads only
files the manifest lists, and refuses by name a file the directory holds that the manifest does not list."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model import ByteTokenizer, ReformerConfig, ReformerLM
from model.pooling import EmbeddingStats
from model.tokenizer import Tokenizer
from model.tokenizers.files import HF_FILE, TokenizerFileError, read_tokenizer, sizing_file, write_tokenizer_files

from .embedding_stats import STATS_FILE, read_embedding_stats, write_embedding_stats

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = HF_FILE  # a `tokenizers` file; older artifacts: the byte tokenizer's description
MANIFEST_FILE = "manifest.json"
ONNX_FILE = "model.onnx"
ONNX_INT8_FILE = "model.int8.onnx"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # optional: the Jinja chat template, as transformers saves it
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "default_artifact"


class ArtifactError(Exception):
    """An artifact that cannot be trusted: the message names the file and what is wrong with it."""


@dataclass
class Artifact:
    path: Path
    model: ReformerLM  # eval mode, on CPU
    tokenizer: Tokenizer
    config: ReformerConfig
    manifest: dict[str, Any]
    sha256: str  # of model.safetensors: identifies the weights
    onnx_path: Path | None
    onnx_int8_path: Path | None = None
    embedding_stats: EmbeddingStats | None = None  # for whitening (or standardising) mean-pooled embeddings
    chat_template: str | None = None  # the Jinja source of the chat template, when the artifact carries one


# --------------------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def code_version() -> str:
    """`git describe` of the source tree this code runs from, when it is a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=root,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _state_for_saving(model: ReformerLM) -> dict[str, torch.Tensor]:
    # safetensors refuses views that share storage; every tensor is copied out contiguous on CPU
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def write_model_files(model: ReformerLM, tokenizer: Tokenizer, directory: Path) -> None:
    """config.json, model.safetensors (config in its metadata too) and the tokenizer's files
    (model/tokenizers/files.py)."""
    model.config.to_json(directory / CONFIG_FILE)
    # one metadata entry: safetensors writes several in hash order, which would make the bytes (and the
    # artifact's sha256) differ between two exports of the same weights
    meta = {"config": json.dumps(model.config.to_dict(), sort_keys=True)}
    save_file(_state_for_saving(model), str(directory / WEIGHTS_FILE), metadata=meta)
    write_tokenizer_files(tokenizer, directory)


def file_entry(path: Path) -> dict[str, Any]:
    """A file's record in the manifest's "files" table, as check_files compares it."""
    return {"sha256": file_sha256(path), "size": path.stat().st_size}


def manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def write_manifest(directory: Path, provenance: dict[str, Any], evaluation: dict[str, Any],
                   export: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in the directory (except the manifest) and write manifest.json."""
    files = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST_FILE:
            files[p.name] = file_entry(p)
    provenance = dict(provenance)
    provenance.setdefault("code_version", code_version())
    manifest = {
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
        "provenance": provenance,
        "evaluation": evaluation,
        "export": export,
    }
    (directory / MANIFEST_FILE).write_text(manifest_text(manifest))
    return manifest


def save_artifact(
    model: ReformerLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    provenance: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    onnx: bool = True,
    quantize: str | None = None,
    eval_text: bytes | None = None,
    overwrite: bool = False,
    embedding_stats: tuple[EmbeddingStats | None, dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write an artifact directory. With `onnx`, the ONNX graph is exported and verified against torch;
    an export whose logits differ by more than the tolerance raises and leaves nothing at `out_dir`.
    `quantize="int8"` adds a dynamically quantised graph and records the bits-per-byte change.
    `embedding_stats` (export/embedding_stats.py's stats_for_export): the statistics, written to
    embedding_stats.safetensors when present, and the manifest's record of how (or why not) they were made.
    `chat_template`: a Jinja chat template's source, written to chat_template.jinja (checked to parse first)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace it)")
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    if quantize and not onnx:
        raise ValueError("quantize='int8' quantises the ONNX graph: it needs onnx=True")
    if chat_template is not None:
        check_chat_template(chat_template, "chat_template")
    model.config.refuse_key_conv("an artifact (the service decodes through the cache)")
    model = model.eval()
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_model_files(model, tokenizer, staging)
        if chat_template is not None:
            (staging / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        export_info: dict[str, Any] = {}
        evaluation = dict(evaluation or {})
        if embedding_stats is not None:
            stats, export_info["embedding_stats"] = embedding_stats
            if stats is not None:
                write_embedding_stats(staging / STATS_FILE, stats)
        if onnx:
            from .onnx_budget import export_sized

            # verified on what the model's size affords (all cases for small models), with progress
            export_info["onnx"] = export_sized(model, staging / ONNX_FILE)
        if quantize == "int8":
            from .quantize import quantize_and_evaluate

            export_info["int8"], evaluation["int8"] = quantize_and_evaluate(
                model, staging / ONNX_FILE, staging / ONNX_INT8_FILE, tokenizer, eval_text)
        write_manifest(staging, provenance or {}, evaluation, export_info)
        _make_readable(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def replace_embedding_stats(directory: str | Path, stats: EmbeddingStats, record: dict[str, Any]) -> dict[str, Any]:
    """Rewrite an artifact's embedding_stats.safetensors with `stats` and its manifest to match: the file's
    sha256 and size, and `record` as export.embedding_stats; every other entry (weights, graphs, provenance,
    evaluation) stays as it was. The artifact must load and check out before (so nothing unverified is
    re-signed by the new manifest) and does after. Both files are written beside their targets and moved
    into place, stats first: an interruption leaves either the old pair or a hash mismatch that loading
    refuses, never a silently mismatched pair. Returns the new manifest."""
    directory = Path(directory)
    art = load_artifact(directory)
    expected = 2 * art.config.hidden_size
    if tuple(stats.mean.shape) != (expected,):
        raise ValueError(f"statistics of {tuple(stats.mean.shape)} dimensions do not fit the artifact's "
                         f"{expected} (twice hidden_size)")
    manifest = dict(art.manifest)
    umask = os.umask(0)
    os.umask(umask)
    tmp_stats = directory / f".{STATS_FILE}.tmp"
    tmp_manifest = directory / f".{MANIFEST_FILE}.tmp"
    try:
        write_embedding_stats(tmp_stats, stats)
        read_embedding_stats(tmp_stats, expected)  # what loading will check, before anything is replaced
        manifest["files"] = {**manifest["files"], STATS_FILE: file_entry(tmp_stats)}
        manifest["export"] = {**dict(manifest.get("export") or {}), "embedding_stats": record}
        tmp_manifest.write_text(manifest_text(manifest))
        for p in (tmp_stats, tmp_manifest):
            p.chmod(0o644 & ~umask)  # safetensors writes owner-only files; the service may run as another user
        os.replace(tmp_stats, directory / STATS_FILE)
        os.replace(tmp_manifest, directory / MANIFEST_FILE)
    finally:
        tmp_stats.unlink(missing_ok=True)
        tmp_manifest.unlink(missing_ok=True)
    load_artifact(directory)  # raises ArtifactError if the rewritten pair does not check out
    return manifest


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; an artifact is read by other users (the service
    in a container), so it gets the usual modes, less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o755 & ~umask)
    for p in directory.iterdir():
        p.chmod(0o644 & ~umask)


# --------------------------------------------------------------------------------------------------
def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory (it does not exist or is not a directory)")
    if not path.is_file():
        raise ArtifactError(f"{MANIFEST_FILE}: missing from {directory}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{MANIFEST_FILE}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{MANIFEST_FILE}: expected a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{MANIFEST_FILE}: unknown format_version {version!r} (this reader knows {FORMAT_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{MANIFEST_FILE}: no 'files' table")
    for name in REQUIRED_FILES:
        if name not in files:
            raise ArtifactError(f"{name}: not listed in {MANIFEST_FILE}")
    return manifest


def _mount_machinery(p: Path) -> bool:
    """A folder the artifact's volume puts there, not a file of the artifact: `lost+found` at a filesystem's
    root, and a Kubernetes ConfigMap or Secret mount's `..data` link and `..<timestamp>` folder (the listed
    files are links through them). Only folders: a file of either name is still refused."""
    return (p.name == "lost+found" or p.name.startswith("..")) and p.is_dir()


def check_listing(directory: Path, manifest: dict[str, Any]) -> None:
    """Everything in the directory but the manifest must be listed in it: the loader reads only listed (and
    so hashed) files, and a file that is there but not listed (a chat template or a tokenizer file added
    by hand, a leftover) would otherwise be ignored or, worse, read unchecked. Refused by name."""
    listed = set(manifest["files"])
    extra = sorted(p.name for p in directory.iterdir()
                   if p.name != MANIFEST_FILE and p.name not in listed and not _mount_machinery(p))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ArtifactError(f"{extra[0]}: in {directory} but not listed in {MANIFEST_FILE}{more}; every file of "
                            f"an artifact is listed with its sha256: remove it, or re-export the artifact")


def check_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Every listed file must exist with the recorded size and sha256."""
    for name, entry in sorted(manifest["files"].items()):
        if Path(name).name != name:
            raise ArtifactError(f"{MANIFEST_FILE}: file name {name!r} is not a plain name")
        p = directory / name
        if not p.is_file():
            raise ArtifactError(f"{name}: missing from {directory}")
        size = p.stat().st_size
        if size != entry.get("size"):
            what = "truncated" if size < int(entry.get("size") or 0) else "size differs"
            raise ArtifactError(f"{name}: {what}: {size} bytes, manifest says {entry.get('size')}")
        digest = file_sha256(p)
        if digest != entry.get("sha256"):
            raise ArtifactError(f"{name}: altered: sha256 {digest} does not match the manifest's {entry.get('sha256')}")


def check_shapes(model: ReformerLM, state: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ArtifactError(f"{WEIGHTS_FILE}: tensor {missing[0]!r} that {CONFIG_FILE} implies is missing"
                            f" ({len(missing)} missing in all)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ArtifactError(f"{WEIGHTS_FILE}: tensor {unexpected[0]!r} is not part of the model"
                            f" {CONFIG_FILE} describes")
    for name, param in expected.items():  # the model's own order: the first wrong tensor is named
        want, tensor = tuple(param.shape), state[name]
        if tuple(tensor.shape) != want:
            raise ArtifactError(f"{WEIGHTS_FILE}: tensor {name!r} has shape {tuple(tensor.shape)}, but {CONFIG_FILE}"
                                f" implies {want}")


def load_artifact(path: str | Path | None = None, *, check_hashes: bool = True) -> Artifact:
    """Load and check an artifact (the shipped default when `path` is None)."""
    directory = Path(path) if path is not None else DEFAULT_ARTIFACT
    manifest = read_manifest(directory)
    check_listing(directory, manifest)
    if check_hashes:
        check_files(directory, manifest)
    try:
        config = ReformerConfig.from_json(directory / CONFIG_FILE)
    except (ValueError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{CONFIG_FILE}: not a valid model configuration ({e})") from e
    try:
        config.refuse_key_conv("the service")
    except ValueError as e:
        raise ArtifactError(f"{CONFIG_FILE}: {e}") from e
    try:
        tokenizer = read_tokenizer(directory, listed=set(manifest["files"]))
    except TokenizerFileError as e:
        raise ArtifactError(str(e)) from e
    if tokenizer.vocab_size != config.vocab_size:
        raise ArtifactError(f"{sizing_file(directory)}: the {tokenizer.kind} tokenizer has "
                            f"{tokenizer.vocab_size} ids, but the model's vocab_size is {config.vocab_size} "
                            f"({CONFIG_FILE})")
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{WEIGHTS_FILE}: cannot be read as safetensors ({e})") from e
    model = ReformerLM(config)
    check_shapes(model, state)
    model.load_state_dict(state)
    model.eval()
    files = manifest["files"]
    onnx_path = directory / ONNX_FILE if ONNX_FILE in files else None
    int8_path = directory / ONNX_INT8_FILE if ONNX_INT8_FILE in files else None
    stats = None
    if STATS_FILE in files:  # optional: older artifacts and exports without training data have none
        try:
            stats = read_embedding_stats(directory / STATS_FILE, 2 * config.hidden_size)
        except ValueError as e:
            raise ArtifactError(f"{STATS_FILE}: {e}") from e
    chat_template = None
    if CHAT_TEMPLATE_FILE in files:  # optional: an artifact without one answers chat requests 400
        try:
            chat_template = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{CHAT_TEMPLATE_FILE}: not UTF-8 text ({e})") from e
        try:
            check_chat_template(chat_template, CHAT_TEMPLATE_FILE)
        except ValueError as e:
            raise ArtifactError(str(e)) from e
    return Artifact(path=directory, model=model, tokenizer=tokenizer, config=config, manifest=manifest,
                    sha256=files[WEIGHTS_FILE]["sha256"], onnx_path=onnx_path, onnx_int8_path=int8_path,
                    embedding_stats=stats, chat_template=chat_template)


def check_chat_template(source: str, name: str) -> None:
    """Raise ValueError naming `name` unless `source` parses as a Jinja template (jinja2 is imported only
    here: artifacts without a template never need it)."""
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"{name}: not a valid Jinja template (line {e.lineno}: {e.message})") from e
