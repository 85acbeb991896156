"""`run_scenarios`: every scenario of a file through one engine, resumable, writing as it goes.

Generation goes through `backends.vllm_stream.StreamDriver` (continuous batching) on the vLLM
backend, or scenario by scenario through `pipeline.rounds.generate_tokens` on the reference.
Contexts are encoded in batches as scenarios are admitted; finished scenarios are decoded and
written by a background thread, so the engine keeps stepping while a video is encoded. Each
written scenario appends one line to `DIR/results.jsonl` (id, status, seed, frames, seconds,
paths, digest); a re-run skips every id whose line says done, whose files exist and whose content
is unchanged. The folder is held by one run at a time (`outdir.OutDirLock`), and a file is replaced
only when an earlier run recorded it for the same scenario, or with `overwrite`.

A results log that cannot be appended ends the run with one line (OutputError); nothing waits
forever on the writer: `put` gives up when it has died, and the interrupt path never blocks on a
full queue.

`ScenarioJob` is the whole request as plain data: `prepare_job` validates it without a model,
`run_scenario_job` loads the engine and runs it, and `scenarios.parallel` hands the same job to
one worker process per GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Container, Iterator

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError, OutputError
from terra_cli.scenarios.outdir import (RESULTS_NAME, SHARD_RESULTS_GLOB, OutDirLock, check_out_dir,  # noqa: F401
                                        make_out_dir, plan_outputs, read_results, results_logs)
from terra_cli.scenarios.spec import Scenario, ScenarioFile

ENCODE_BATCH = 16  # scenarios whose contexts are encoded together
VIDEO_FPS = 10
WRITER_QUEUE = 64  # finished scenarios waiting for the writer (tokens only: small)
WAIT_SECONDS = 0.2  # how often a blocked put or close looks at whether the writer is still alive


@dataclass
class ScenarioRun:
    done: int = 0
    skipped: int = 0
    failed: int = 0
    resumed: int = 0
    generated_frames: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def completed_ids(out_dir: Path) -> set[str]:
    """Ids whose results line says done and whose files are all there (results.jsonl, and the logs
    of data-parallel workers that a crash kept from being folded in)."""
    out_dir = Path(out_dir)
    done: set[str] = set()
    for results in results_logs(out_dir):
        for record in read_results(results):
            if record.get("status") == "done" and all((out_dir / p).is_file() for p in record.get("paths", [])):
                done.add(str(record.get("id")))
    return done


class ResultsLog:
    """Appends one JSON line per scenario, flushed and synced, under a lock (writer thread + main).
    A failed append raises an OutputError naming the log."""

    def __init__(self, out_dir: Path, name: str = RESULTS_NAME):
        self.path = Path(out_dir) / name
        self.lock = threading.Lock()

    def add(self, record: dict) -> None:
        from terra_cli.media.atomic import describe_os_error

        line = json.dumps(record, sort_keys=True) + "\n"
        with self.lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise OutputError(describe_os_error(exc, self.path).replace("cannot write", "cannot append to", 1)) \
                    from exc


def check_scenarios(file: ScenarioFile, skip_invalid: bool) -> None:
    if file.problems and not skip_invalid:
        listed = "; ".join(str(p).rstrip(";.") for p in file.problems)
        raise InputError(f"{file.path}: {len(file.problems)} invalid scenario line(s): {listed} "
                         "(fix them, or pass --skip-invalid to skip those lines)")


def run_scenarios(
    file: ScenarioFile,
    out_dir: Path,
    backend,
    tokenizer,
    *,
    max_rollouts: int,
    skip_invalid: bool = False,
    temperature: float = 0.9,
    top_k: int = 0,
    top_p: float = 1.0,
    on_progress: Callable[[ScenarioRun, int], None] = lambda run, total: None,
    on_written: Callable[[dict], None] = lambda record: None,
    only_ids: set[str] | None = None,
    results_name: str = RESULTS_NAME,
    decode: bool = True,
    overwrite: bool = False,
    lock: bool = True,
) -> ScenarioRun:
    """Generate and write every pending scenario (of `only_ids`, when given: a data-parallel
    worker's share, whose skipped lines the parent records). KeyboardInterrupt stops generation;
    scenarios already finished are still written before it propagates. `overwrite` lets existing
    files be replaced and changed scenarios run again; `lock` False: the caller holds --out-dir
    (a data-parallel parent)."""
    check_scenarios(file, skip_invalid)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    make_out_dir(out_dir)
    decode = decode and tokenizer is not None
    with OutDirLock(out_dir) if lock else contextlib.nullcontext():
        mine = file.scenarios if only_ids is None else [s for s in file.scenarios if s.id in only_ids]
        plan = plan_outputs(mine, out_dir, decode=decode, overwrite=overwrite)
        log = ResultsLog(out_dir, results_name)
        run = ScenarioRun(resumed=plan.resumed)
        if only_ids is None:
            run.skipped = log_skipped(file, log)
        pending = plan.pending
        by_key = {s.id: s for s in pending}
        started = {s.id: 0.0 for s in pending}
        writer = _Writer(out_dir, tokenizer if decode else None, log, run, on_written, plan.replaceable)
        clock = time.perf_counter()

        def sampling(s: Scenario) -> Sampling:
            return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s.seed)

        def progress() -> None:
            writer.check()  # a dead writer ends the run now, not after the next scenario
            on_progress(run, len(pending))

        def finished(key: str, tokens: np.ndarray) -> None:
            s = by_key[key]
            writer.put(s, tokens, time.perf_counter() - started[key])
            run.generated_frames += s.frames - s.context_frames

        try:
            if getattr(backend, "name", "") == "vllm":
                from terra_cli.backends.vllm_stream import RolloutJob, StreamDriver

                def jobs() -> Iterator[RolloutJob]:
                    for s, context in _encoded(pending, tokenizer):
                        started[s.id] = time.perf_counter()
                        yield RolloutJob(s.id, context, s.actions, s.frames, sampling(s))

                StreamDriver(backend, max_rollouts).run(
                    jobs(), on_frame=lambda job, i, t: progress(),
                    on_done=lambda job, tokens: finished(job.key, tokens.copy()))
            else:
                from terra_cli.pipeline.rounds import generate_tokens

                for s, context in _encoded(pending, tokenizer):
                    started[s.id] = time.perf_counter()
                    tokens = generate_tokens(backend, context, s.actions, s.frames, sampling(s),
                                             on_frame=lambda i, t: progress())[0]
                    finished(s.id, tokens)
        except BaseException:
            writer.close(quiet=True)  # writes what is finished; the first error is the one reported
            raise
        finally:
            run.seconds = time.perf_counter() - clock
        writer.close()
        run.seconds = time.perf_counter() - clock
    return run


def log_skipped(file: ScenarioFile, log: ResultsLog) -> int:
    for problem in file.problems:
        log.add({"id": None, "line": problem.line, "status": "skipped", "reason": problem.message})
    return len(file.problems)


def _encoded(scenarios: list[Scenario], tokenizer) -> Iterator[tuple[Scenario, np.ndarray]]:
    """(scenario, context tokens (K, T)) in order; image contexts encoded ENCODE_BATCH scenarios at a time."""
    from terra_cli.pipeline.inputs import load_context_tokens, read_context_frames

    for start in range(0, len(scenarios), ENCODE_BATCH):
        chunk = scenarios[start : start + ENCODE_BATCH]
        images, owners = [], []
        for s in chunk:
            if s.context_tokens is None:
                frames = read_context_frames(list(s.context_images), s.context_frames) if s.context_images \
                    else _sample_road(s.context_frames)
                images.extend(frames)
                owners.append((s, len(frames)))
        encoded = iter(tokenizer.tokenize(images)) if images else iter(())
        contexts = {}
        for s, count in owners:
            contexts[s.id] = np.stack([next(encoded) for _ in range(count)])
        for s in chunk:
            if s.context_tokens is not None:
                yield s, load_context_tokens(s.context_tokens, s.context_frames)
            else:
                yield s, contexts[s.id]


def _sample_road(count: int) -> list[np.ndarray]:
    from terra_cli.models.default import sample_context_frames

    return list(sample_context_frames(count))


class _Writer:
    """A background thread that decodes and writes finished scenarios (bounded queue). A scenario
    counts as written once its line is in the results log; if the log cannot be appended the
    thread stops, and `check`, `put` and `close` raise that error in the caller's thread."""

    def __init__(self, out_dir: Path, tokenizer, log: ResultsLog, run: ScenarioRun, on_written: Callable[[dict], None],
                 replaceable: Container[str] = ()):
        self.out_dir, self.tokenizer, self.log, self.run = out_dir, tokenizer, log, run
        self.on_written, self.replaceable = on_written, replaceable
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=WRITER_QUEUE)
        self.thread = threading.Thread(target=self._work, name="terra-scenario-writer", daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, scenario: Scenario, tokens: np.ndarray, seconds: float) -> None:
        while True:  # never waits on a writer that is gone
            self.check()
            if not self.thread.is_alive():
                raise OutputError("the scenario writer stopped before every scenario was written")
            try:
                self.queue.put((scenario, tokens, seconds), timeout=WAIT_SECONDS)
                return
            except queue.Full:
                continue

    def close(self, quiet: bool = False) -> None:
        """Write what is queued and stop. Waits only while the writer makes progress; a second
        Ctrl-C or SIGTERM interrupts the wait. `quiet`: the caller is already raising."""
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=WAIT_SECONDS)
                break
            except queue.Full:
                continue
        while self.thread.is_alive():
            self.thread.join(WAIT_SECONDS)
        if not quiet:
            self.check()

    def _work(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                self._write(*item)
        except BaseException as exc:  # handed to the main thread, which ends the run with it
            self.error = exc

    def _write(self, scenario: Scenario, tokens: np.ndarray, seconds: float) -> None:
        written: list[str] = []
        common = {"id": scenario.id, "seed": scenario.seed, "line": scenario.line, "digest": scenario.digest}
        try:
            paths = write_scenario(self.out_dir, scenario, tokens, self.tokenizer, overwrite=self.replaceable,
                                   written=written)
        except Exception as exc:  # one scenario's failed write must not stop the others
            record = {**common, "status": "failed", "reason": " ".join(str(exc).split()), "paths": written}
        else:
            record = {**common, "status": "done", "frames": int(tokens.shape[0]), "seconds": round(seconds, 2),
                      "paths": paths}
        try:
            self.log.add(record)
        except OutputError as exc:
            _remove(self.out_dir, written)  # not recorded: a re-run makes them again
            dropped = f" ({scenario.id}'s files, written but not recorded, were removed)" if written else ""
            raise OutputError(f"{exc}; the run stopped with {self.run.done} scenario(s) written and recorded{dropped}; "
                              "fix that, then run the same command again to resume") from exc
        if record["status"] == "done":
            self.run.done += 1
        else:
            self.run.failed += 1
            self.run.errors.append(f"{scenario.id}: {record['reason']}")
        self.on_written(record)


def _remove(out_dir: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            (out_dir / name).unlink()


def write_scenario(out_dir: Path, scenario: Scenario, tokens: np.ndarray, tokenizer, *,
                   overwrite: bool | Container[str] = False, written: list[str] | None = None) -> list[str]:
    """`{stem}.npy` (all frames' tokens) and, with a tokenizer, `{stem}.mp4`; each atomic. An
    existing file is replaced only if `overwrite` is True or names it (`plan_outputs` says which);
    otherwise the write fails and nothing is replaced. `written` collects the names as they land."""
    from terra_cli.media.atomic import atomic_save_npy
    from terra_cli.media.frames import write_video

    def may_replace(name: str) -> bool:
        return overwrite if isinstance(overwrite, bool) else name in overwrite

    written = [] if written is None else written
    stem = scenario.output_stem
    (out_dir / stem).parent.mkdir(parents=True, exist_ok=True)
    tokens_name = f"{stem}.npy"
    atomic_save_npy(out_dir / tokens_name, tokens.astype(np.int64), overwrite=may_replace(tokens_name))
    written.append(tokens_name)
    if tokenizer is None:
        return [tokens_name]
    video_name = f"{stem}.mp4"
    write_video(out_dir / video_name, list(tokenizer.decode_tokens(tokens)), fps=VIDEO_FPS,
                overwrite=may_replace(video_name))
    written.append(video_name)
    return [video_name, tokens_name]
