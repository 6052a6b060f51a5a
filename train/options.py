"""The options of `reformer train` (train/loop.py) and the model configuration they describe."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from model.config import ReformerConfig

from .corpus import add_corpus_args
from .data import DataError
from .phases import parse_phases
from .recipe import add_recipe_args

DESCRIPTION = "`reformer train`: train a causal byte-level Reformer on a directory (or list) of UTF-8 text files."

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reformer train", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", nargs="*", help="text files, or directories of *.txt files (none: --corpus's folders)")
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoint/, cache/, train_log.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--resume-from", type=Path, help="continue from this checkpoint directory")
    p.add_argument("--init-from", type=Path,
                   help="fine-tune: start from the weights and config of this artifact directory or training "
                        "checkpoint, with a fresh optimizer, step count and schedule (not a resume)")
    p.add_argument("--rehash", type=parse_rehash, metavar="BUCKETS[xHASHES]",
                   help="with --init-from: replace the model's num_buckets (a number, or auto: 2 x length / "
                        "chunk per call, as the reference) and optionally num_hashes, e.g. 1024x4. No weight "
                        "depends on them: the hash rotations are drawn from hash_seed for the new shape")
    p.add_argument("--successor-heads", type=parse_successor_heads, metavar="N | N1,N2,...",
                   help="successor-value heads per LSH layer (heads 0..N-1 read the value of the position after "
                        "each key; one count for every LSH layer or one per LSH layer). Applies to a new model "
                        "and to --init-from (the weights load unchanged: no weight depends on it); with --resume "
                        "it must match the checkpoint's")
    p.add_argument("--key-conv", type=int, metavar="WIDTH",
                   help="an experiment: n-gram keys, a causal depthwise convolution of WIDTH positions on each "
                        "LSH layer's input before its query/key projection (0: none). Applies to a new model and "
                        "to --init-from (the convolution starts as the identity, so the model starts unchanged); "
                        "with --resume it must match the checkpoint's. Only the PyTorch forward computes it: "
                        "such a model cannot be exported to an artifact or decoded with the cache")
    m = p.add_argument_group("model (ignored with --resume or --init-from: that model's config is used)")
    m.add_argument("--config", type=Path, help="ReformerConfig JSON; overrides the flags below")
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--num-heads", type=int, default=4)
    m.add_argument("--attn-layers", default="local,lsh,local,lsh")
    m.add_argument("--feed-forward-size", type=int, default=512)
    m.add_argument("--chunk-length", type=int, default=64, help="LSH and local attention chunk length")
    m.add_argument("--num-hashes", type=int, default=2)
    m.add_argument("--num-buckets", type=int, default=64, help="fixed (required for ONNX export)")
    m.add_argument("--hash-seed", type=int, default=0)
    m.add_argument("--axial-pos-shape", default="16,4096", help="two factors; product >= max positions")
    m.add_argument("--max-positions", type=int, default=65536)
    m.add_argument("--axial-norm-std", type=float, default=0.02,
                   help="init std of the axial position embeddings (the reference uses 1.0, which buries the "
                        "0.02-std token embeddings under position noise for hundreds of steps)")
    m.add_argument("--init-std", type=float, default=0.1,
                   help="init std of linear and token-embedding weights (the reference's 0.02 leaves attention "
                        "near-uniform: a small model then sits on the bigram plateau for thousands of steps)")
    m.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout (0: a small model in a short run underfits, not overfits)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--window", type=int, default=512, help="training window in bytes (tokens), without --phases")
    o.add_argument("--batch-size", type=int, default=16, help="windows per micro-step, per rank, without --phases")
    o.add_argument("--phases", type=parse_phases,
                   help="WINDOWxBATCH:SHARE,... e.g. 512x16:70%%,16384x1:30%%: the shares split --max-steps, or "
                        "without it --time-budget (default: one phase of --window x --batch-size)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    o.add_argument("--lr", type=float, default=2e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --lr")
    o.add_argument("--warmup-steps", type=int, default=100)
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    o.add_argument("--random-offsets", action=argparse.BooleanOptionalAction, default=False,
                   help="shift each micro-batch's positions by a random offset so every axial row is trained")
    o.add_argument("--zero-offset-prob", type=float, default=0.25, help="probability the offset is 0")
    o.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA only; ignored with a note on CPU)")
    o.add_argument("--reversible", default="auto", choices=["auto", "on", "off"],
                   help="reversible backward (recomputes each layer, memory flat in depth) or plain autograd "
                        "(faster); auto: plain when its activations fit in a quarter of free memory, per phase")
    o.add_argument("--compile", action="store_true",
                   help="torch.compile the forward and loss (one compile per phase window; pays on long runs)")
    o.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("run")
    r.add_argument("--max-steps", type=int, help="optimizer steps in total (also the cosine schedule length)")
    r.add_argument("--stop-at-step", type=int,
                   help="stop and save at this step without changing the schedule (resume later)")
    r.add_argument("--time-budget",
                   help="wall-clock limit for this invocation: 600, 600s, 80m, 1.5h (without --max-steps the "
                        "cosine schedule follows this clock, so the run is not bit-reproducible)")
    r.add_argument("--eval-every", type=int, default=200, help="validate every N steps (0: only at the end)")
    r.add_argument("--eval-every-s", type=float, default=0.0,
                   help="also validate every this many seconds of wall time (0: off)")
    r.add_argument("--val-window", type=int,
                   help="validation window in bytes (default: the longest phase window, at most 4096)")
    r.add_argument("--val-windows", type=int, default=16, help="validation windows at intervals (0: all)")
    r.add_argument("--final-val-windows", type=int, default=0, help="validation windows at the end (0: all)")
    r.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps")
    r.add_argument("--val-fraction", type=float, default=0.05, help="tail of each document held out")
    r.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    r.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    r.add_argument("--ddp", default="wrap", choices=["wrap", "allreduce"],
                   help="multi-process gradient sync: DistributedDataParallel, or an explicit all-reduce")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    add_corpus_args(p)
    add_recipe_args(p)
    return p


def parse_rehash(text: str) -> tuple[int | None, int | None]:
    """'1024x4' -> (1024, 4); 'auto' -> (None, None): num_buckets automatic, num_hashes kept."""
    buckets, _, hashes = text.strip().lower().partition("x")
    try:
        nb = None if buckets == "auto" else int(buckets)
        nh = int(hashes) if hashes else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read --rehash {text!r}: use e.g. 1024, 1024x4 or autox4") from None
    if (nb is not None and (nb < 2 or nb % 2)) or (nh is not None and nh < 1):
        raise argparse.ArgumentTypeError(f"--rehash {text!r}: buckets must be even and >= 2, hashes >= 1")
    return nb, nh


def parse_successor_heads(text: str) -> int | list[int]:
    """'4' -> 4 (every LSH layer); '4,2' -> [4, 2] (one count per LSH layer, in order)."""
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read --successor-heads {text!r}: use e.g. 4 or 4,2") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"--successor-heads {text!r}: counts must be >= 0")
    return counts[0] if len(counts) == 1 else counts


def with_model_options(cfg: ReformerConfig, args: argparse.Namespace) -> ReformerConfig:
    """`cfg` with --successor-heads and --key-conv applied, each where given; the config's own checks refuse a
    value by the flag's name (a head count that does not fit its heads or LSH layers, a negative width)."""
    for flag, field, value in (("--successor-heads", "lsh_successor_heads", args.successor_heads),
                               ("--key-conv", "lsh_key_conv_width", args.key_conv)):
        if value is None:
            continue
        try:
            cfg = dataclasses.replace(cfg, **{field: value})
        except ValueError as e:
            raise DataError(f"{flag}: {e}") from None
    return cfg


def init_config(cfg: ReformerConfig, args: argparse.Namespace) -> ReformerConfig:
    """The --init-from model's config with --rehash, --successor-heads and --key-conv applied: converting
    plain heads to successor-value heads keeps every weight (the heads relearn to use them, ~100 steps on
    short windows); a new key convolution starts as the identity."""
    return with_model_options(rehashed(cfg, args.rehash), args)


def check_resume_config(cfg: ReformerConfig, args: argparse.Namespace) -> None:
    """--successor-heads and --key-conv given with --resume must be the checkpoint's: a resumed model keeps its
    shape."""
    if args.successor_heads is not None and args.successor_heads != cfg.lsh_successor_heads:
        raise DataError(f"--successor-heads {args.successor_heads} differs from the checkpoint's "
                        f"{cfg.lsh_successor_heads}: a resumed run keeps its model")
    if args.key_conv is not None and args.key_conv != cfg.lsh_key_conv_width:
        raise DataError(f"--key-conv {args.key_conv} differs from the checkpoint's {cfg.lsh_key_conv_width}: a "
                        "resumed run keeps its model")


def rehashed(cfg: ReformerConfig, rehash: tuple[int | None, int | None] | None) -> ReformerConfig:
    """The --init-from model's config with --rehash applied (unchanged without it)."""
    if rehash is None:
        return cfg
    nb, nh = rehash
    return dataclasses.replace(cfg, num_buckets=nb, num_hashes=nh if nh is not None else cfg.num_hashes)


def model_config(args: argparse.Namespace) -> ReformerConfig:
    """The new model the options describe (a --config file, or the flags), with --successor-heads and
    --key-conv applied."""
    return with_model_options(_base_config(args), args)


def _base_config(args: argparse.Namespace) -> ReformerConfig:
    if args.config is not None:
        return ReformerConfig.from_json(args.config)
    hidden, heads = args.hidden_size, args.num_heads
    shape = tuple(int(v) for v in args.axial_pos_shape.split(","))
    if hidden % heads or hidden % 2:
        raise DataError(f"--hidden-size {hidden} must be even and divisible by --num-heads {heads}")
    p = args.dropout
    return ReformerConfig(
        vocab_size=258, hidden_size=hidden, num_attention_heads=heads, attention_head_size=hidden // heads,
        attn_layers=args.attn_layers.split(","), feed_forward_size=args.feed_forward_size,
        lsh_attn_chunk_length=args.chunk_length, local_attn_chunk_length=args.chunk_length,
        num_hashes=args.num_hashes, num_buckets=args.num_buckets, hash_seed=args.hash_seed,
        axial_pos_shape=shape, axial_pos_embds_dim=(hidden // 2, hidden // 2),  # type: ignore[arg-type]
        max_position_embeddings=args.max_positions, axial_norm_std=args.axial_norm_std,
        initializer_range=args.init_std, hidden_dropout_prob=p,
        lsh_attention_probs_dropout_prob=p, local_attention_probs_dropout_prob=p, is_decoder=True,
        pad_token_id=0, eos_token_id=1)
