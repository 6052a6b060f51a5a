"""Writes a small random-weight artifact (with a verified ONNX graph), a placeholder for tests or for a
checkout without the trained default model.

    python -m export.random_default OUT_DIR [--force]

Writing into the packaged export/default_artifact/ (which holds the shipped trained model) or over any
non-empty directory needs `--force`: a placeholder must never replace a trained model by accident.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from model import ByteTokenizer, ReformerConfig, ReformerLM

from .artifact import DEFAULT_ARTIFACT, save_artifact

# the training defaults' shape family (chunks of 64, 2 hash rounds, 64 buckets, 64K positions), smaller
PLACEHOLDER_CONFIG = dict(
    vocab_size=258, hidden_size=64, num_attention_heads=2, attention_head_size=32,
    attn_layers=["local", "lsh", "local", "lsh"], feed_forward_size=256, lsh_attn_chunk_length=64,
    local_attn_chunk_length=64, num_hashes=2, num_buckets=64, hash_seed=0, axial_pos_shape=(16, 4096),
    axial_pos_embds_dim=(32, 32), max_position_embeddings=65536, is_decoder=True, pad_token_id=0, eos_token_id=1,
)
SEED = 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.random_default", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help=f"where to write (the packaged {DEFAULT_ARTIFACT.name} needs --force)")
    p.add_argument("--force", action="store_true",
                   help="replace a non-empty OUT_DIR, including the packaged default artifact")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    out: Path = args.out_dir
    if not args.force and out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "the packaged default artifact (the shipped trained model)" if (
            out.resolve() == DEFAULT_ARTIFACT.resolve()) else "a non-empty directory"
        print(f"error: {out} is {what}; refusing to replace it with random weights (pass --force to do so)",
              file=sys.stderr)
        return 2
    torch.manual_seed(SEED)
    model = ReformerLM(ReformerConfig(**PLACEHOLDER_CONFIG)).eval()  # type: ignore[arg-type]
    provenance = {
        "note": "placeholder with random weights",
        "data": {}, "steps": 0, "seed": SEED, "command": "python -m export.random_default",
    }
    save_artifact(model, out, tokenizer=ByteTokenizer(), provenance=provenance,
                  evaluation={"validation_bits_per_byte": None}, onnx=True, overwrite=args.force)
    print(f"wrote {out} ({model.num_parameters():,} parameters, random weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
