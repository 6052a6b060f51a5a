"""`reformer train`: train a causal byte-level Reformer on a directory (or list) of UTF-8 text files.

    reformer train [DATA...] --out runs/NAME [--max-steps N] [--time-budget 80m] [--resume]
                   [--phases 512x16:70%,16384x1:30%] [--reversible auto] [--compile]
                   [--corpus data,corpus] [--files GLOBS] [--exclude-files GLOBS]      (train/corpus.py)
                   [--mix passkey=0.4,copy=0.3,prose=0.3] [--curriculum 512x8:400,1024x4] (train/recipe.py)
    torchrun --nproc_per_node 2 -m service.cli train ...      (DistributedDataParallel: gloo / NCCL)

Windows are sampled as a pure function of (seed, step, micro-step) and dropout is re-seeded per step,
so a run is reproducible and a resumed run continues exactly as an uninterrupted one would."""

from __future__ import annotations

import argparse
import csv
import gc
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

from .checkpoint import TrainerState, code_version, load_init_weights, load_training_state, save_checkpoint
from .corpus import check_listed_digests, resolve_sources, select_files
from .data import Corpus, DataError, WindowSampler, prepare_corpus, validation_windows
from .evaluation import load_lm
from .options import build_parser, check_resume_config, init_config, model_config
from .phases import Phase, phase_at
from .recipe import recipe_from_args
from .recipe_run import CURVE_FIELDS as RECIPE_CURVE_FIELDS
from .recipe_run import RecipeRun, make_weighted_loss_fn
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
        recipe = recipe_from_args(args)  # None: the long-range recipe is off and nothing below changes
        self.recipe = RecipeRun(recipe, self.phases, corpus, args.seed, args.max_steps) if recipe else None
        if self.recipe is not None:
            self.phases = self.recipe.phases
        for ph in self.phases:
            if cfg.padded_length(ph.window) > cfg.max_position_embeddings:
                flag = "--curriculum window" if args.curriculum else "--phases window" if args.phases else "--window"
                raise DataError(f"{flag} {ph.window} is longer than the model's max_position_embeddings "
                                f"{cfg.max_position_embeddings}")
        self.val_window = args.val_window or min(max(ph.window for ph in self.phases), 4096)
        torch.manual_seed(args.seed)
        self.lm = ReformerLM(cfg).to(device).train()
        if init is not None:  # --init-from: its weights; the optimizer and schedule start fresh
            load_init_weights(self.lm, init)
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
        self.samplers = ([] if self.recipe else
                         [WindowSampler(corpus.train, ph.window, args.seed) for ph in self.phases])
        self.autocast = autocast_dtype(device, args.bf16)
        self.loss_fn = make_loss_fn(self.model, self.autocast, device.type, compile=args.compile)
        if self.recipe is not None:
            self.weighted_loss = make_weighted_loss_fn(self.model, self.autocast, device.type, self.recipe.recipe)
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

    def micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """This rank's rows of the global micro-batch, the position offset (shared by the batch) and, with
        the recipe, the answer kind of every target (None without it)."""
        ph = self.phases[self.phase]
        rows = ph.batch_size * self.info.world_size
        mine_of = slice(self.info.rank * ph.batch_size, (self.info.rank + 1) * ph.batch_size)
        kinds = None
        if self.recipe is not None:
            mixed = self.recipe.samplers[self.phase]
            rng = mixed.rng(step, micro)
            batch, all_kinds = mixed.global_batch(rng, rows)
            kinds = torch.from_numpy(np.ascontiguousarray(all_kinds[mine_of])).to(self.device)
        else:
            sampler = self.samplers[self.phase]
            rng = sampler.rng(step, micro)
            batch = sampler.global_batch(rng, rows)
        mine = batch[mine_of]  # (b, window+1)
        offset = 0
        max_offset = self.lm.config.max_position_embeddings - self.lm.config.padded_length(ph.window)
        if self.args.random_offsets and max_offset > 0 and rng.random() >= self.args.zero_offset_prob:
            offset = int(rng.integers(0, max_offset + 1))
        return torch.from_numpy(np.ascontiguousarray(mine)).to(self.device), offset, kinds

    def train_step(self, step: int) -> float:
        args = self.args
        # dropout draws from the global generator: re-seed per step (and rank) so resume is exact
        torch.manual_seed((args.seed * 1_000_003 + step) * 1024 + self.info.rank)
        progress = self.progress(step)
        self.enter_phase(self.recipe.index(step, progress, self.state.stage_floor) if self.recipe
                         else phase_at(self.phases, progress))
        lr = args.lr * lr_factor(progress, step, args.warmup_steps, args.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for micro in range(args.grad_accum):
            ids, offset, kinds = self.micro_batch(step, micro)
            sync = micro == args.grad_accum - 1 or not isinstance(self.model, DistributedDataParallel)
            ctx = self.model.no_sync() if not sync else _null()  # type: ignore[operator]
            with ctx:
                if self.recipe is None or kinds is None:
                    loss = self.loss_fn(ids, offset)
                else:
                    loss, ce = self.weighted_loss(ids, offset, kinds)
                    self.recipe.meter.add(ce, kinds)
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
            "corpus": {"sets": list(self.args.corpus or ()), "files": list(self.args.files),
                       "exclude_files": list(self.args.exclude_files)},
            **({"recipe": self.recipe.provenance()} if self.recipe else {}),
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
        if self.recipe is not None:
            extra, floor = self.recipe.validation(self.lm, self.phase, self.state.stage_floor, self.device,
                                                  self.info, self.autocast)
            entry.update(extra)
            if floor != self.state.stage_floor:
                self.state.stage_floor = floor
                self.log({"event": "advance", "step": self.state.step, "to_stage": floor})
        self.state.history.append(entry)
        self.log({"event": "validation", **entry})
        if self.info.is_main:
            write_curve(self.run_dir / "curve.csv", self.state.history,
                        CURVE_FIELDS + (RECIPE_CURVE_FIELDS if self.recipe else []))
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
        if self.recipe is not None and self.state.step == 0:
            # a first curve row before any step: the starting model's answer loss, to see retrieval form against
            self.enter_phase(self.recipe.index(0, 0.0, self.state.stage_floor))
            self.record_val(self.validate(args.val_windows), bar)
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


def write_curve(path: Path, history: list[dict[str, Any]], fields: list[str] = CURVE_FIELDS) -> None:
    """The validation curve so far as CSV (bench/training/plot_training.py draws it); rewritten whole each time."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
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
        files = select_files(resolve_sources(args.data, args.corpus), args.files, args.exclude_files)
        if info.is_main:  # rank 0 checks the digests and builds the token cache; the others wait, then read it
            check_listed_digests(files)
            corpus = prepare_corpus(list(files), args.out / "cache", args.val_fraction)
        if info.enabled:
            torch.distributed.barrier()
        if not info.is_main:
            corpus = prepare_corpus(list(files), args.out / "cache", args.val_fraction)
        init = None
        if args.init_from is not None:
            if resume_source(args) is not None:
                raise DataError("--init-from starts a new run from a model's weights; it cannot be combined "
                                "with --resume or --resume-from")
            init = initial_model(args.init_from)
        if args.rehash is not None and init is None:
            raise DataError("--rehash changes the hashing of an --init-from model; for a new model use "
                            "--num-buckets and --num-hashes")
        cfg = init_config(init.config, args) if init is not None else model_config(args)
        src = resume_source(args)
        if src is not None:
            from .checkpoint import read_checkpoint_metadata

            if (src / "model.safetensors").exists():
                cfg = ReformerConfig.from_dict(read_checkpoint_metadata(src)["config"])
                check_resume_config(cfg, args)
        trainer = Trainer(args, argv, info, device, corpus, cfg, init)
        if info.is_main:
            print(f"model: {trainer.lm.num_parameters():,} parameters; data: {corpus.train.num_tokens:,} "
                  f"training / {corpus.val.num_tokens:,} validation bytes from {len(corpus.files)} files; "
                  f"device {device}, {info.world_size} process(es)", file=sys.stderr)
            for note in trainer.recipe.warnings(trainer.lm.config) if trainer.recipe else []:
                print(f"reformer train: {note}", file=sys.stderr)
        code = trainer.run()
        if info.enabled:
            # leave together: once, under a loaded CI machine, rank 1 aborted ("terminate called without an
            # active exception") tearing down its process group while rank 0 was still writing the checkpoint
            torch.distributed.barrier()
            # and free the DDP wrapper (its reducer holds gloo work with tensors) while the interpreter is
            # whole: left in a reference cycle to the interpreter's finalization, destroying it can abort the
            # process the same way (seen again under CI's load with the barrier in place)
            del trainer
            gc.collect()
        return code
    except (DataError, ValueError) as e:
        print(f"reformer train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if info.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
