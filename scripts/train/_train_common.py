"""Helpers shared by scripts/train/train_tokenizer.py and scripts/train/train_world_model.py.

Both training scripts render rollouts of `terra_cli.synthetic_world` in a pool of CPU workers,
log with a timestamp counted from the start, stop by a wall-clock deadline, follow the same
warmup + cosine LR schedule, checkpoint to OUT/ckpt/state.pt for --resume, and append rows to
OUT/log.csv. Those pieces live here once, so that the two scripts cannot drift apart; what is
specific to a model (losses, data layout, export format, command line) stays in each script.

The scripts run as `python3 scripts/train_*.py`, which puts scripts/ on sys.path, so they import
this module as `_train_common`. torch is imported inside the functions that need it: the scripts
fork their render pool before torch (and CUDA) are touched, and `--help` stays fast.
"""

from __future__ import annotations

import contextlib
import csv
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

# The scripts' clock: log timestamps and the --max-minutes deadline count from here (this module
# is imported at the top of each script, so this is the script's start).
T_START = time.time()


def log(msg: str) -> None:
    """Print msg with the seconds since the start, flushed so that piped logs keep pace."""
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Rendering synthetic rollouts in worker processes


def render_job(job):
    """(index, frames, actions) of one dataset rollout; job = (seed, index, frames).

    A module-level function, so that the worker pool can pickle it by name.
    """
    from terra_cli.synthetic.dataset import render_dataset_rollout

    seed, index, frames = job
    imgs, actions = render_dataset_rollout(seed, index, frames)
    return index, imgs, actions


def render_workers(requested: int | None) -> int:
    """--workers, or all CPU cores but one (rendering is CPU-bound and the main process has work too)."""
    return requested if requested is not None else max(1, (os.cpu_count() or 2) - 1)


def render_rollouts(seed: int, n_rollouts: int, frames: int, workers: int, chunksize: int):
    """Iterator of (index, frames, actions) for rollouts 0..n_rollouts-1 of dataset `seed`.

    With workers > 0 the pool is started (forked) here, before the iterator is consumed: callers
    call this before they touch CUDA, which must not be initialised in a process that forks.
    Results then come in completion order, not by index. With workers == 0 the rollouts are
    rendered in this process, in order, as the iterator is consumed. The pool is closed and joined
    once the iterator is exhausted, and terminated if consumption stops early or fails.
    """
    jobs = [(seed, i, frames) for i in range(n_rollouts)]
    if workers <= 0:
        return map(render_job, jobs)
    ctx = mp.get_context("fork" if sys.platform != "win32" else "spawn")
    pool = ctx.Pool(workers)
    return _drain(pool, pool.imap_unordered(render_job, jobs, chunksize=chunksize))


def _drain(pool, results):
    try:
        yield from results
    except BaseException:  # includes GeneratorExit: the caller stopped early
        pool.terminate()
        raise
    pool.close()
    pool.join()


# ----------------------------------------------------------------------------------------------
# Time limit and learning rate


def deadline_and_schedule(args, train_seconds: float, save_margin_s: float) -> tuple[float, float]:
    """(deadline, LR schedule length in training seconds).

    The deadline is --max-minutes after the start, less save_margin_s (time kept to save the
    checkpoint and the final export; none under --smoke). The schedule is --schedule-minutes if
    given, else what is left until the deadline plus the training time of earlier (resumed) runs,
    so that one uninterrupted run ends its cosine at the deadline.
    """
    deadline = T_START + args.max_minutes * 60 - (save_margin_s if not args.smoke else 0)
    sched_seconds = (args.schedule_minutes * 60 if args.schedule_minutes
                     else max(deadline - time.time() + train_seconds, 1.0))
    return deadline, sched_seconds


def lr_at(args, sched_seconds: float, step_i: int, seconds: float) -> float:
    """Linear warmup over --warmup steps, then cosine from --lr down to --lr * --min-lr-ratio.

    The cosine follows steps when --steps is given, else training seconds over sched_seconds
    (training is usually time-limited, and the step rate is not known in advance).
    """
    if step_i < args.warmup:
        return args.lr * (step_i + 1) / args.warmup
    progress = step_i / args.steps if args.steps else seconds / sched_seconds
    progress = min(max(progress, 0.0), 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device):
    """bf16 autocast on CUDA, a no-op context elsewhere (CPU smoke runs stay in float32)."""
    if device.type == "cuda":
        import torch

        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Checkpoint (OUT/ckpt/state.pt) for --resume


def load_state(resume: bool, ckpt_path: Path, model, opt, config: dict, mismatch: str) -> tuple[int, float]:
    """(step, training seconds) to start from: (0, 0.0), or those of ckpt_path under --resume.

    On resume, loads model, optimiser and torch RNG state in place. A checkpoint of another model
    config is an error, not something to start over from silently: mismatch is the message,
    formatted with {path}, {saved} (the checkpoint's config) and {wanted} (config).
    """
    import torch

    if resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if state["config"] != config:
            raise SystemExit(mismatch.format(path=ckpt_path, saved=state["config"], wanted=config))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, train_seconds = state["step"], state["train_seconds"]
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {ckpt_path} at step {step} ({train_seconds / 60:.1f} training minutes)")
        return step, train_seconds
    if resume:
        log(f"--resume: no {ckpt_path}, starting fresh")
    return 0, 0.0


def save_state(ckpt_path: Path, model, opt, step: int, train_seconds: float, config: dict, args) -> None:
    """Write what load_state needs (and the arguments, for the record) to ckpt_path.

    Written to a temporary file and renamed, so that a run killed while saving leaves the previous
    checkpoint intact.
    """
    import torch

    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "train_seconds": train_seconds,
                "config": config, "torch_rng": torch.get_rng_state(),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}, tmp)
    os.replace(tmp, ckpt_path)


def add_run_arguments(p, *, smoke_help: str, schedule_default: str, lr: float, weight_decay: float,
                      val_every: int) -> None:
    """The options both trainers share: where, how long, the LR schedule and the bookkeeping
    that TrainingClock reads."""
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt/state.pt")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: time-limited)")
    p.add_argument("--max-minutes", type=float, default=9.0, help="stop (and save) by then, counted from the start")
    p.add_argument("--schedule-minutes", type=float, default=None,
                   help="length of the LR schedule in training minutes, summed over resumed runs "
                        f"(default: {schedule_default}; with --steps the schedule follows steps)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--val-every", type=int, default=val_every)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)


class TrainingClock:
    """What both trainers' loops share around their own step: the step budget (--steps), the
    wall-clock deadline, the LR schedule, the log rows and the checkpoints (--ckpt-every).

        clock = TrainingClock(args, opt, ckpt_path, step, train_seconds, save_margin_s, log_csv, fields, write_state)
        while clock.next_step():   # sets the LR, or says the run is over
            ...one optimizer step...
            clock.count_step()
            clock.record(row)      # row: metrics when clock.logs_now() / validates_now(), else None
        clock.stop()
    """

    def __init__(self, args, opt, ckpt_path: Path, step: int, train_seconds: float, save_margin_s: float,
                 log_csv: Path, fields: list[str], write_state):
        self.args, self.opt, self.ckpt_path = args, opt, ckpt_path
        self.step, self.train_seconds = step, train_seconds
        self.deadline, self.sched_seconds = deadline_and_schedule(args, train_seconds, save_margin_s)
        self.csv_file, self.writer = open_csv_log(log_csv, fields, args.resume)
        self._write_state = write_state  # write_state(step, train_seconds)
        self.lr, self.stop_reason = 0.0, None
        self._segment_start, self._last_saved = time.time(), step

    def seconds(self) -> float:
        """Training seconds so far, earlier (resumed) runs included."""
        return self.train_seconds + time.time() - self._segment_start

    def next_step(self) -> bool:
        if self.args.steps is not None and self.step >= self.args.steps:
            self.stop_reason = "steps"
        elif time.time() >= self.deadline:
            self.stop_reason = "time"
        if self.stop_reason:
            return False
        self.lr = lr_at(self.args, self.sched_seconds, self.step, self.seconds())
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        return True

    def count_step(self) -> None:
        self.step += 1

    def record(self, row: dict | None) -> None:
        if row is not None:
            write_row(self.csv_file, self.writer, row | {"step": self.step, "time_s": round(self.seconds(), 1), "lr": self.lr})
        if self.step % self.args.ckpt_every == 0:
            self._save()

    def logs_now(self) -> bool:
        return self.step % self.args.log_every == 0 or self.step == self.args.steps

    def validates_now(self) -> bool:
        return self.step % self.args.val_every == 0 or self.step == self.args.steps

    def stop(self) -> None:
        """Save unless the last step just did, and close the log."""
        if self.step != self._last_saved:
            self._save()
        else:
            self._stop_segment()
        self.csv_file.close()
        log(f"stopped ({self.stop_reason}) at step {self.step}; checkpoint {self.ckpt_path}")

    def _stop_segment(self) -> None:
        now = time.time()
        self.train_seconds += now - self._segment_start
        self._segment_start = now

    def _save(self) -> None:
        self._stop_segment()
        self._write_state(self.step, self.train_seconds)
        self._last_saved = self.step
        self._segment_start = time.time()  # writing the checkpoint is not training time


# ----------------------------------------------------------------------------------------------
# OUT/log.csv


def open_csv_log(path: Path, fields: list[str], resume: bool):
    """(file, csv.DictWriter) for the training log: appended to under --resume, else started anew with a header."""
    new_csv = not path.is_file() or not resume
    csv_file = open(path, "w" if new_csv else "a", newline="")
    writer = csv.DictWriter(csv_file, fieldnames=fields)
    if new_csv:
        writer.writeheader()
    return csv_file, writer


def write_row(csv_file, writer, row: dict) -> None:
    """Append row to the CSV (floats rounded, only the writer's columns; flushed, so that a killed
    run keeps its log) and print it in full."""
    writer.writerow({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items() if k in writer.fieldnames})
    csv_file.flush()
    log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
