"""Import of a `transformers` Reformer checkpoint (a local directory with config.json plus model.safetensors or
pytorch_model.bin, or a hub id such as google/reformer-crime-and-punishment, downloaded by export/hf_hub.py) as
an artifact with its tokenizer (export/hf_tokenizer.py), after checking that our model gives the same logits
as transformers' on random inputs."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from model import ReformerConfig, ReformerLM
from model.hf import hf_state_dict_to_ours

from .artifact import ArtifactError, check_shapes, file_sha256, save_artifact
from .hf_errors import HFImportError
from .hf_hub import resolve_checkpoint
from .hf_tokenizer import checkpoint_tokenizer

log = logging.getLogger(__name__)
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")  # huggingface_hub names an LFS file's blob by its sha256


def read_hf_checkpoint(hf_dir: Path) -> tuple[ReformerConfig, dict[str, torch.Tensor], Path]:
    """-> (our config, the checkpoint's state dict under transformers' names, the weights file)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise HFImportError(f"{config_path}: missing (a transformers checkpoint directory has config.json)")
    try:
        hf_config = json.loads(config_path.read_text())
        config = ReformerConfig.from_hf(hf_config)
    except (ValueError, TypeError, KeyError) as e:
        raise HFImportError(f"{config_path}: not a Reformer configuration ({e})") from e
    if hf_config.get("model_type") not in (None, "reformer"):
        raise HFImportError(f"{config_path}: model_type is {hf_config.get('model_type')!r}, not 'reformer'")
    st, pt = hf_dir / "model.safetensors", hf_dir / "pytorch_model.bin"
    if st.is_file():
        try:
            state = load_file(str(st))
        except (SafetensorError, OSError) as e:
            raise HFImportError(f"{st}: cannot be read as safetensors ({e})") from e
        return config, state, st
    if pt.is_file():
        try:
            # weights_only: tensors and plain containers only, no arbitrary unpickling
            state = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError, ... for a bad file
            raise HFImportError(f"{pt}: cannot be loaded as a weights-only PyTorch state dict ({e})") from e
        if not isinstance(state, dict):
            raise HFImportError(f"{pt}: holds a {type(state).__name__}, not a state dict")
        return config, state, pt
    raise HFImportError(f"{hf_dir}: neither model.safetensors nor pytorch_model.bin found")


def check_weights_file(weights: Path, state: dict[str, torch.Tensor]) -> str:
    """The weights file's sha256, after two checks for a damaged copy that still parses: where the file is a
    huggingface_hub cache snapshot (a link to blobs/<sha256 of the content>, as a download leaves it) its
    content must hash to that name, and every floating-point tensor must be finite (flipped exponent bits
    give NaN or inf, which the logits check would only report as a NaN difference)."""
    digest = file_sha256(weights)
    target = weights.resolve()
    if target.parent.name == "blobs" and _HUB_BLOB.fullmatch(target.name) and digest != target.name:
        raise HFImportError(f"{weights}: altered or incompletely downloaded: its sha256 is {digest}, but the hub "
                            f"cache blob it links to is named by the sha256 {target.name}")
    for name, tensor in state.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise HFImportError(f"{weights}: tensor {name!r} holds {bad} NaN or infinite values of "
                                    f"{tensor.numel()}: the file is damaged (or the checkpoint diverged)")
    return digest


def build_model(config: ReformerConfig, hf_state: dict[str, torch.Tensor], weights: Path) -> ReformerLM:
    model = ReformerLM(config)
    ours = hf_state_dict_to_ours(hf_state)
    try:
        check_shapes(model, ours)
    except ArtifactError as e:
        # the same checks as artifact loading, reported against the checkpoint's file and names
        raise HFImportError(f"{weights.name}: {str(e).split(': ', 1)[1]}") from e
    model.load_state_dict(ours)
    return model.eval()


def parity_lengths(config: ReformerConfig) -> list[int]:
    m = math.lcm(*config.chunk_lengths())
    top = config.max_position_embeddings
    return sorted({min(n, top) for n in (max(1, m // 2), 2 * m, 3 * m + 5)})


# parameters x tokens the parity inputs may cost per model (each is run by both models): two rows at every
# length up to ~35M parameters at google/reformer-enwik8's lengths (128, 512, 773), one row above. At its
# 149M parameters two rows took 160 s of a 180 s import on two loaded cores; one row runs every path the
# second did (a chunk, several chunks and hashing, a padded length) at half the cost
PARITY_BUDGET = 1e11


def parity_rows(parameters: int, lengths: list[int]) -> int:
    """Rows per parity input: 2 while parameters x 2 x sum(lengths) fits PARITY_BUDGET, else 1."""
    return 2 if parameters * 2 * sum(lengths) <= PARITY_BUDGET else 1


def load_reference(hf_dir: Path, config: ReformerConfig) -> Any:
    """transformers' model of the checkpoint, in eval, hashing with our seed (hash_seed None in the reference
    draws fresh rotations per call; ours is fixed, config.hash_seed). Raises HFImportError when transformers
    cannot be imported."""
    try:
        from transformers import ReformerConfig as HFConfig
        from transformers import ReformerModelWithLMHead
    except ImportError as e:
        raise HFImportError(
            f"the logits parity check needs transformers, which cannot be imported ({e}): "
            "pip install transformers, or pass --skip-parity to write the artifact unchecked "
            "(its manifest then records that parity was skipped)") from e
    hf_config = HFConfig.from_pretrained(str(hf_dir))
    hf_config.hash_seed = config.hash_seed
    hf_config.is_decoder = config.is_decoder
    return ReformerModelWithLMHead.from_pretrained(str(hf_dir), config=hf_config).eval()


def check_hf_parity(hf_model: Any, model: ReformerLM, where: str, seed: int = 0,
                    force_buckets: bool = True, lengths: list[int] | None = None) -> dict[str, Any]:
    """Logits of transformers' model against ours on random inputs of parity_lengths (export/hf_parity.py:
    both models hash into our buckets, transformers' own choices are checked to be near-ties where they
    differ). Raises HFImportError naming what differs. `force_buckets=False` is the plain comparison,
    which a near-tie can fail; it raises nothing. `lengths` replaces parity_lengths (tests)."""
    from .hf_parity import HF_PARITY_TOLERANCE, BucketStats, compare, reset_num_buckets

    g = torch.Generator().manual_seed(seed)
    stats, worst = BucketStats(), 0.0
    lengths = lengths or parity_lengths(model.config)
    params = model.num_parameters()
    rows = parity_rows(params, lengths)
    with torch.random.fork_rng(devices=[]):  # transformers seeds the global generator for its hashing
        for n in tqdm(lengths, desc="parity with transformers", unit="input", disable=None, leave=False):
            ids = torch.randint(0, model.config.vocab_size, (rows, n), generator=g)
            reset_num_buckets(hf_model)
            start = time.perf_counter()
            worst = max(worst, compare(model, hf_model, ids, stats, where, force=force_buckets))
            log.info("parity with transformers at %d x %d tokens: max abs diff %.3g (%.1f s)", rows, n, worst,
                     time.perf_counter() - start)
    record: dict[str, Any] = {"checked": True, "max_abs_diff": worst, "lengths": lengths, "batch": rows,
                              "seed": seed, "tolerance": HF_PARITY_TOLERANCE}
    if rows == 1:
        record["why_one_row"] = (f"{params:,} parameters x 2 rows x {sum(lengths):,} tokens exceed the budget of "
                                 f"{PARITY_BUDGET:.0e} parameter-tokens: one row at each length")
    if force_buckets:
        record["buckets"] = stats.record()
    return record


def import_hf(hf_dir: str | Path, out_dir: str | Path, onnx: bool = True, quantize: str | None = None,
              overwrite: bool = False, command: str | None = None, skip_parity: bool = False,
              revision: str | None = None, cache_dir: str | Path | None = None,
              token: str | bool | None = None) -> tuple[Path, dict[str, Any]]:
    """Convert, check parity against transformers (unless `skip_parity`, which the manifest records), write
    the artifact. `hf_dir` is a local folder or a hub id (`revision`, `cache_dir` and `token` are
    huggingface_hub's, for a hub id). Returns (path, parity record)."""
    src = resolve_checkpoint(hf_dir, revision=revision, cache_dir=cache_dir, token=token)
    start = time.perf_counter()
    config, hf_state, weights = read_hf_checkpoint(src)
    tokenizer, tokenizer_source = checkpoint_tokenizer(src, config)
    digest = check_weights_file(weights, hf_state)
    log.info("read %s: %s tensors, %.0f MB (%.1f s)", weights.name, len(hf_state), weights.stat().st_size / 1e6,
             time.perf_counter() - start)
    if skip_parity:
        model = build_model(config, hf_state, weights)
        parity: dict[str, Any] = {"checked": False, "reason": "skipped (--skip-parity)"}
    else:
        from .hf_parity import config_differences

        start = time.perf_counter()
        hf_model = load_reference(src, config)
        log.info("loaded transformers' model of the checkpoint (%.1f s)", time.perf_counter() - start)
        # before the weights: a layer kind read wrongly shows as a missing tensor, which hides the cause
        differences = config_differences(config, hf_model.config)
        if differences:
            raise HFImportError(f"{src / 'config.json'}: our model reads the configuration differently from "
                                f"transformers: {'; '.join(differences)}; not writing an artifact")
        model = build_model(config, hf_state, weights)
        parity = check_hf_parity(hf_model, model, weights.name)
        del hf_model  # its weights are not needed for the ONNX export that follows
    del hf_state
    files = {"config.json": file_sha256(src / "config.json"), weights.name: digest}
    if (src / tokenizer_source).is_file():
        files[tokenizer_source] = file_sha256(src / tokenizer_source)
    provenance = {
        "source": "transformers Reformer checkpoint",
        "hf_dir": str(src.resolve()),
        "files": files,
        "tokenizer": {"kind": tokenizer.kind, "from": tokenizer_source},
        "command": command or f"reformer import-hf {hf_dir} {out_dir}",
    }
    if str(hf_dir) != str(src):
        provenance["hub"] = {"repo_id": str(hf_dir), "revision": revision or "main",
                             "commit": src.name if src.parent.name == "snapshots" else None}
    out = save_artifact(model, out_dir, tokenizer=tokenizer, provenance=provenance,
                        evaluation={"transformers_parity": parity}, onnx=onnx, quantize=quantize,
                        overwrite=overwrite,
                        embedding_stats=(None, {"skipped": "imported without training data: mean-pooled embeddings "
                                                           "are served raw"}))
    return out, parity
