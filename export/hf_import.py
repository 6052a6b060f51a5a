"""Import of a local `transformers` Reformer checkpoint directory (config.json plus model.safetensors or
pytorch_model.bin, e.g. a downloaded google/reformer-enwik8) as an artifact, after checking that our
model gives the same logits as transformers' on random inputs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model import ByteTokenizer, ReformerConfig, ReformerLM
from model.hf import hf_state_dict_to_ours

from .artifact import ArtifactError, check_shapes, file_sha256, save_artifact

HF_PARITY_TOLERANCE = 1e-4
log = logging.getLogger(__name__)


class HFImportError(Exception):
    """The checkpoint cannot be imported; the message names the file and what is wrong."""


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


def check_hf_parity(hf_dir: Path, model: ReformerLM, seed: int = 0) -> dict[str, Any]:
    """Logits of transformers' model loaded from `hf_dir` vs ours, on random inputs. The reference draws
    fresh rotations per call when hash_seed is unset; ours uses the config's seed, so the reference is
    given the same seed for the comparison. Raises HFImportError when transformers cannot be imported."""
    try:
        from transformers import ReformerConfig as HFConfig
        from transformers import ReformerModelWithLMHead
    except ImportError as e:
        raise HFImportError(
            f"the logits parity check needs transformers, which cannot be imported ({e}): "
            "pip install transformers, or pass --skip-parity to write the artifact unchecked "
            "(its manifest then records that parity was skipped)") from e
    hf_config = HFConfig.from_pretrained(str(hf_dir))
    hf_config.hash_seed = model.config.hash_seed
    hf_config.is_decoder = model.config.is_decoder
    hf_model = ReformerModelWithLMHead.from_pretrained(str(hf_dir), config=hf_config).eval()
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    lengths = parity_lengths(model.config)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (2, n), generator=g)
            ref = hf_model(ids, use_cache=False).logits
            got = model(ids).logits
            worst = max(worst, float((ref - got).abs().max()))
    return {"checked": True, "max_abs_diff": worst, "lengths": lengths, "batch": 2, "seed": seed,
            "tolerance": HF_PARITY_TOLERANCE}


def tokenizer_for(config: ReformerConfig, weights: Path) -> ByteTokenizer:
    if config.vocab_size == 258:
        return ByteTokenizer(eos_id=2)  # bytes + 2, as google/reformer-enwik8 (NUL doubles as end of text)
    raise HFImportError(
        f"{weights.name}: vocab_size {config.vocab_size} is not byte-level (258); only byte-level Reformer "
        "checkpoints can be imported (sentencepiece tokenizers such as crime-and-punishment's are not supported)")


def import_hf(hf_dir: str | Path, out_dir: str | Path, onnx: bool = True, quantize: str | None = None,
              overwrite: bool = False, command: str | None = None,
              skip_parity: bool = False) -> tuple[Path, dict[str, Any]]:
    """Convert, check parity against transformers (unless `skip_parity`, which the manifest records), write
    the artifact. Returns (path, parity record)."""
    src = Path(hf_dir)
    config, hf_state, weights = read_hf_checkpoint(src)
    tokenizer = tokenizer_for(config, weights)
    model = build_model(config, hf_state, weights)
    if skip_parity:
        parity: dict[str, Any] = {"checked": False, "reason": "skipped (--skip-parity)"}
    else:
        parity = check_hf_parity(src, model)
    if parity["checked"] and not parity["max_abs_diff"] <= HF_PARITY_TOLERANCE:
        raise HFImportError(f"{weights.name}: our logits differ from transformers' by {parity['max_abs_diff']:.3g}"
                           f" (> {HF_PARITY_TOLERANCE}); not writing an artifact")
    provenance = {
        "source": "transformers Reformer checkpoint",
        "hf_dir": str(src.resolve()),
        "files": {p.name: file_sha256(p) for p in (src / "config.json", weights)},
        "command": command or f"reformer import-hf {src} {out_dir}",
    }
    out = save_artifact(model, out_dir, tokenizer=tokenizer, provenance=provenance,
                        evaluation={"transformers_parity": parity}, onnx=onnx, quantize=quantize,
                        overwrite=overwrite,
                        embedding_stats=(None, {"skipped": "imported without training data: mean-pooled embeddings "
                                                           "are served raw"}))
    return out, parity
