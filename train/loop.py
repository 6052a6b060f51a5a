"""`reformer train`: train a causal byte-level Reformer on a directory (or list) of UTF-8 text files.

    reformer train DATA... --out runs/NAME [--max-steps N] [--time-budget 80m] [--resume]
                   [--phases 512x16:70%,16384x1:30%] [--reversible auto] [--compile]
    torchrun --nproc_per_node 2 -m service.cli train ...      (DistributedDataParallel: gloo / NCCL)

Windows are sampled as a pure function of (seed, step, micro-step) and dropout is re-seeded per step,
so a run is reproducible and a resumed run continues exactly as an uninterrupted one would."""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from model.config import ReformerConfig
from model.decoding.runtime import tune_cpu_runtime
from model.reformer import ReformerLM

from .checkpoint import TrainerState, code_version, load_training_state, save_checkpoint
from .data import Corpus, DataError, WindowSampler, prepare_corpus, validation_windows
from .evaluation import load_lm
from .phases import Phase, parse_phases, phase_at
from .runtime import (
    DistInfo,
    StopFlag,
    all_reduce_sum,
    average_gradients,
    evaluate_bpb,
    init_distributed,
    lr_factor,
    max_weight_divergence,
    parse_duration,
)
from .step import autocast_dtype, choose_reversible, make_loss_fn

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reformer train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", nargs="+", help="text files, or directories of *.txt files")
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoint/, cache/, train_log.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--resume-from", type=Path, help="continue from this checkpoint directory")
    p.add_argument("--init-from", type=Path,
                   help="fine-tune: start from the weights and config of this artifact directory or training "
                        "checkpoint, with a fresh optimizer, step count and schedule (not a resume)")
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
    return p


def model_config(args: argparse.Namespace) -> ReformerConfig:
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


def resume_source(args: argparse.Namespace) -> Path | None:
    if args.resume_from is not None:
        return Path(args.resume_from)
    return args.out / "checkpoint" if args.resume else None


def initial_model(path: Path) -> ReformerLM:
    """The model `--init-from` starts from: an artifact directory or a training checkpoint, read as every
    other command reads them (train/evaluation.py load_lm); a path that is neither is a DataError."""
    from export import ArtifactError
    from export.checkpoint import CheckpointError

    try:
        return load_lm(path)[0]
    except (ArtifactError, CheckpointError) as e:
        raise DataError(f"--init-from {path}: {e}") from e


def pick_device(name: str, info: DistInfo) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


class Trainer:
    def __init__(self, args: argparse.Namespace, argv: list[str], info: DistInfo, device: torch.device,
                 corpus: Corpus, cfg: ReformerConfig, init: ReformerLM | None = None) -> None:
        self.args, self.argv, self.info, self.device, self.corpus = args, argv, info, device, corpus
        self.phases: list[Phase] = args.phases or [Phase(args.window, args.batch_size, 1.0)]
        for ph in self.phases:
            if cfg.padded_length(ph.window) > cfg.max_position_embeddings:
                flag = "--phases window" if args.phases else "--window"
                raise DataError(f"{flag} {ph.window} is longer than the model's max_position_embeddings "
                                f"{cfg.max_position_embeddings}")
        self.val_window = args.val_window or min(max(ph.window for ph in self.phases), 4096)
        torch.manual_seed(args.seed)
        self.lm = ReformerLM(cfg).to(device).train()
        if init is not None:  # --init-from: its weights; the optimizer and schedule start fresh
            self.lm.load_state_dict(init.state_dict())
        decay = [p for n, p in self.lm.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
        other = [p for n, p in self.lm.named_parameters() if not (p.dim() >= 2 and "embeddings" not in n)]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=args.lr, betas=(0.9, 0.99), fused=True)  # one kernel for all parameters, CPU and CUDA
        self.state = TrainerState(seed=args.seed)
        self.run_dir: Path = args.out
        self.ckpt_dir = self.run_dir / "checkpoint"
        src = resume_source(args)
        if src is not None:
            if not (src / "model.safetensors").exists():
                raise DataError(f"--resume: no checkpoint at {src}")
            self.state = load_training_state(src, self.lm, self.optimizer)
        self.model: torch.nn.Module = self.lm
        if info.enabled and args.ddp == "wrap":
            self.model = DistributedDataParallel(self.lm, device_ids=[device.index] if device.type == "cuda" else None)
        # one sampler per phase, built up front so a window longer than every document fails at start
        self.samplers = [WindowSampler(corpus.train, ph.window, args.seed) for ph in self.phases]
        self.autocast = autocast_dtype(device, args.bf16)
        self.loss_fn = make_loss_fn(self.model, self.autocast, device.type, compile=args.compile)
        self.budget_s = parse_duration(args.time_budget) if args.time_budget else None
        self.phase = -1  # set by enter_phase
        self.code_version = code_version()  # of the code that starts the run, not of a later save
        self.rank_divergence: float | None = None  # measured at the end of a multi-process run
        self.last_loss: float | None = None

    # ----------------------------------------------------------------------------------------------
    def progress(self, step: int) -> float:
        """How far the run is, 0..1: by steps with --max-steps, else by this invocation's wall time."""
        if self.args.max_steps:
            return step / self.args.max_steps
        if self.budget_s:
            return (time.monotonic() - self.t_start) / self.budget_s
        return 0.0

    def enter_phase(self, index: int) -> None:
        if index == self.phase:
            return
        self.phase = index
        ph = self.phases[index]
        self.lm.reversible = choose_reversible(self.args.reversible, self.lm, ph.batch_size, ph.window, self.device)
        self.log({"event": "phase", "phase": index, "window": ph.window, "batch_size": ph.batch_size,
                  "reversible": self.lm.reversible, "step": self.state.step,
                  "wall_time_s": round(self.state.wall_time_s, 1)})
        if self.info.is_main and len(self.phases) > 1:
            print(f"phase {index + 1}/{len(self.phases)}: window {ph.window} x batch {ph.batch_size} from step "
                  f"{self.state.step} ({'reversible' if self.lm.reversible else 'plain autograd'})", file=sys.stderr)

    def micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, int]:
        """This rank's rows of the global micro-batch, and the position offset (shared by the batch)."""
        ph, sampler = self.phases[self.phase], self.samplers[self.phase]
        rng = sampler.rng(step, micro)
        rows = ph.batch_size * self.info.world_size
        batch = sampler.global_batch(rng, rows)
        mine = batch[self.info.rank * ph.batch_size:(self.info.rank + 1) * ph.batch_size]  # (b, window+1)
        offset = 0
        max_offset = self.lm.config.max_position_embeddings - self.lm.config.padded_length(ph.window)
        if self.args.random_offsets and max_offset > 0 and rng.random() >= self.args.zero_offset_prob:
            offset = int(rng.integers(0, max_offset + 1))
        return torch.from_numpy(np.ascontiguousarray(mine)).to(self.device), offset

    def train_step(self, step: int) -> float:
        args = self.args
        # dropout draws from the global generator: re-seed per step (and rank) so resume is exact
        torch.manual_seed((args.seed * 1_000_003 + step) * 1024 + self.info.rank)
        progress = self.progress(step)
        self.enter_phase(phase_at(self.phases, progress))
        lr = args.lr * lr_factor(progress, step, args.warmup_steps, args.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(args.grad_accum):
            ids, offset = self.micro_batch(step, micro)
            sync = micro == args.grad_accum - 1 or not isinstance(self.model, DistributedDataParallel)
            ctx = self.model.no_sync() if not sync else _null()  # type: ignore[operator]
            with ctx:
                loss = self.loss_fn(ids, offset)
                (loss / args.grad_accum).backward()
            total += float(loss.detach()) / args.grad_accum
        if self.info.enabled and args.ddp == "allreduce":
            average_gradients(self.lm, self.info)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.lm.parameters(), args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def validate(self, max_windows: int) -> tuple[float, int]:
        windows = validation_windows(self.corpus.val, self.val_window, max_windows or None)
        if not windows:
            return float("nan"), 0
        return evaluate_bpb(self.lm, windows, self.device, self.info, self.autocast)

    def provenance(self) -> dict[str, Any]:
        return {
            "data_files": self.corpus.provenance(), "steps": self.state.step,
            "tokens_seen": self.state.tokens_seen, "wall_time_s": round(self.state.wall_time_s, 1),
            "seed": self.args.seed, "command": shlex.join(["reformer", "train", *self.argv]),
            "code_version": self.code_version, "world_size": self.info.world_size,
            "parameters": self.lm.num_parameters(), "window": max(ph.window for ph in self.phases),
            "phases": [{"window": ph.window, "batch_size": ph.batch_size, "share": ph.share} for ph in self.phases],
            "val_window": self.val_window,
            "val_fraction": self.args.val_fraction, "device": self.device.type,
            "ddp": self.args.ddp if self.info.enabled else None,
            "max_weight_divergence_across_ranks": self.rank_divergence,
        }

    def save(self, val: tuple[float, int] | None = None) -> None:
        if not self.info.is_main:
            return
        evaluation: dict[str, Any] = {"split": f"held-out tail ({self.args.val_fraction:.0%}) of every document"}
        if val is not None:
            evaluation.update(validation_bpb=round(val[0], 4), validation_bytes=val[1], at_step=self.state.step)
        elif self.state.last_val_bpb is not None:
            evaluation.update(validation_bpb=self.state.last_val_bpb,
                              at_step=self.state.history[-1]["step"] if self.state.history else None)
        save_checkpoint(self.ckpt_dir, self.lm, self.optimizer, self.state, self.provenance(), evaluation,
                        {k: str(v) for k, v in vars(self.args).items()})

    def log(self, record: dict[str, Any]) -> None:
        if self.info.is_main:
            with open(self.run_dir / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def record_val(self, val: tuple[float, int], bar: tqdm) -> None:
        self.state.last_val_bpb = round(val[0], 4)
        entry = {"step": self.state.step, "val_bpb": round(val[0], 4), "val_bytes": val[1],
                 "tokens_seen": self.state.tokens_seen, "wall_time_s": round(self.state.wall_time_s, 1),
                 "phase": self.phase, "train_loss": round(self.last_loss, 4) if self.last_loss is not None else None}
        self.state.history.append(entry)
        self.log({"event": "validation", **entry})
        if self.info.is_main:
            write_curve(self.run_dir / "curve.csv", self.state.history)
        if self.info.is_main:
            bar.write(f"step {self.state.step}: validation {val[0]:.4f} bits per byte ({val[1]} bytes)")

    # ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        args, info = self.args, self.info
        self.t_start = time.monotonic()
        wall_at_start = self.state.wall_time_s
        last_eval = self.t_start
        bar = tqdm(total=args.max_steps, initial=self.state.step, disable=not info.is_main or args.no_progress,
                   unit="step", dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        stopped_by = ""
        with StopFlag() as stop:
            while True:
                if args.max_steps is not None and self.state.step >= args.max_steps:
                    stopped_by = "max-steps"
                    break
                if args.stop_at_step is not None and self.state.step >= args.stop_at_step:
                    stopped_by = "stop-at-step"
                    break
                elapsed = time.monotonic() - self.t_start
                out_of_time = self.budget_s is not None and elapsed >= self.budget_s
                eval_due = bool(args.eval_every_s) and time.monotonic() - last_eval >= args.eval_every_s
                # every rank must agree to stop (or validate) at the same step, or a collective would hang
                flags = all_reduce_sum([float(stop.requested), float(out_of_time), float(eval_due)], info,
                                       self.device)
                if flags[0] or flags[1]:
                    stopped_by = f"signal {stop.signal_name or 'on another rank'}" if flags[0] else "time-budget"
                    break
                if flags[2] and self.state.step > 0:
                    self.record_val(self.validate(args.val_windows), bar)
                    last_eval = time.monotonic()
                t0 = time.monotonic()
                loss = self.train_step(self.state.step)
                self.last_loss = loss
                ph = self.phases[self.phase]
                tokens_per_step = ph.window * ph.batch_size * args.grad_accum * info.world_size
                self.state.step += 1
                self.state.tokens_seen += tokens_per_step
                self.state.wall_time_s = wall_at_start + time.monotonic() - self.t_start
                rate = tokens_per_step / max(time.monotonic() - t0, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", bpb=f"{loss / math.log(2):.3f}", tok_s=f"{rate:,.0f}",
                                left=_left(self.budget_s, elapsed))
                if self.state.step % 10 == 0:
                    self.log({"event": "step", "step": self.state.step, "loss": round(loss, 4),
                              "tokens_per_s": round(rate), "tokens_seen": self.state.tokens_seen, "phase": self.phase,
                              "wall_time_s": round(self.state.wall_time_s, 1)})
                if args.eval_every and self.state.step % args.eval_every == 0:
                    self.record_val(self.validate(args.val_windows), bar)
                    last_eval = time.monotonic()
                if args.save_every and self.state.step % args.save_every == 0:
                    self.save()
        bar.close()
        self.rank_divergence = max_weight_divergence(self.lm, info)
        final = self.validate(args.final_val_windows)
        self.record_val(final, bar)
        self.save(final)
        self.log({"event": "end", "stopped_by": stopped_by, "step": self.state.step})
        if info.is_main:
            print(f"stopped ({stopped_by}) at step {self.state.step}, {self.state.tokens_seen:,} tokens, "
                  f"{self.state.wall_time_s:.0f} s; validation {final[0]:.4f} bits per byte; "
                  f"checkpoint: {self.ckpt_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED if stopped_by.startswith("signal") else 0


CURVE_FIELDS = ["step", "phase", "tokens_seen", "wall_time_s", "val_bpb", "val_bytes", "train_loss"]


def write_curve(path: Path, history: list[dict[str, Any]]) -> None:
    """The validation curve so far as CSV (bench/plot_training.py draws it); rewritten whole each time."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CURVE_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(history)


def _left(budget: float | None, elapsed: float) -> str:
    if budget is None:
        return "-"
    s = max(budget - elapsed, 0.0)
    return f"{int(s // 60)}m{int(s % 60):02d}s"


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_cpu_runtime()
    device_kind = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    info = init_distributed(device_kind)
    try:
        device = pick_device(args.device, info)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DataError("--device cuda: torch sees no CUDA device (this torch build or machine has none)")
        if args.bf16 and device.type != "cuda" and info.is_main:
            print("reformer train: note: --bf16 applies to CUDA only; training in fp32 on the CPU", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        if args.max_steps is None and args.time_budget is None:
            raise DataError("give --max-steps and/or --time-budget, so the run knows when to stop")
        if args.time_budget is not None:
            parse_duration(args.time_budget)
        if info.is_main:  # rank 0 builds the token cache; the others wait, then read it
            corpus = prepare_corpus(args.data, args.out / "cache", args.val_fraction)
        if info.enabled:
            torch.distributed.barrier()
        if not info.is_main:
            corpus = prepare_corpus(args.data, args.out / "cache", args.val_fraction)
        init = None
        if args.init_from is not None:
            if resume_source(args) is not None:
                raise DataError("--init-from starts a new run from a model's weights; it cannot be combined "
                                "with --resume or --resume-from")
            init = initial_model(args.init_from)
        cfg = init.config if init is not None else model_config(args)
        src = resume_source(args)
        if src is not None:
            from .checkpoint import read_checkpoint_metadata

            if (src / "model.safetensors").exists():
                cfg = ReformerConfig.from_dict(read_checkpoint_metadata(src)["config"])
        trainer = Trainer(args, argv, info, device, corpus, cfg, init)
        if info.is_main:
            print(f"model: {trainer.lm.num_parameters():,} parameters; data: {corpus.train.num_tokens:,} "
                  f"training / {corpus.val.num_tokens:,} validation bytes from {len(corpus.files)} files; "
                  f"device {device}, {info.world_size} process(es)", file=sys.stderr)
        code = trainer.run()
        if info.enabled:
            # leave together: once, under a loaded CI machine, rank 1 aborted ("terminate called without an
            # active exception") tearing down its process group while rank 0 was still writing the checkpoint
            torch.distributed.barrier()
        return code
    except (DataError, ValueError) as e:
        print(f"reformer train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if info.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
