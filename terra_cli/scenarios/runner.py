"""`run_scenarios`: every scenario of a file through one engine, resumable, writing as it goes.

Generation goes through the backend's driver (backends/driver.py: continuous batching on vLLM,
lockstep batches on the reference); contexts are read and encoded in batches by a thread, ahead of
the engine (`encoding.EncodeAhead`). Finished scenarios go to a background thread that
writes them, so the engine keeps stepping while a video is made. With `writers` > 0
the tokens are decoded and the mp4 encoded in that many writer processes (`scenarios.writers`),
off this process's interpreter lock, and the thread only places their bytes; with 0 it decodes and
encodes itself. Either way this process is the only one that writes into the folder. Each
written scenario appends one line to `DIR/results.jsonl` (id, status, seed, frames, seconds,
paths, digest); a re-run skips every id whose line says done, whose files exist and whose content
is unchanged. The folder is held by one run at a time (`outdir.OutDirLock`), and a file is replaced
only when an earlier run recorded it for the same scenario, or with `overwrite`.

The engine loop never waits on the writer (a bounded queue that did stalled 256 ACT-Bench samples
for 230 s on an H100: benchmarks/README.md): while the writer is behind, no new scenario starts
(`_Writer.behind`, the job feed's hold). A results log that cannot be appended ends the run with
one line (OutputError); nothing waits forever on a writer that has died.

`ScenarioJob` is the whole request as plain data: `prepare_job` validates it without a model,
`run_scenario_job` loads the engine and runs it, and `scenarios.ray_runner` hands the scenarios
to engine actors on a Ray cluster (`scenarios.ray_actor`), writing what they return through
`save_finished` as this module's writer does.
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
from typing import Callable, Container

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError, OutputError
from terra_cli.scenarios.outdir import (RESULTS_NAME, SHARD_RESULTS_GLOB, OutDirLock, check_out_dir,  # noqa: F401
                                        make_out_dir, plan_outputs, read_results, results_logs)
from terra_cli.scenarios.encoding import ENCODE_BATCH, EncodeAhead, encoded
from terra_cli.scenarios.spec import Scenario, ScenarioFile
from terra_cli.scenarios.writers import WriterDied, WriterPool, decode_frames, start_pool, write_in_order

VIDEO_FPS = 10
# No new scenario starts while this many finished ones (or the rollouts in flight, if more) wait
# for the writer: tokens only, 0.2 MB for an ACT-Bench sample.
WRITER_BACKLOG = 64
WAIT_SECONDS = 0.2  # how often a held admission or close looks at whether the writer is still alive


@dataclass
class ScenarioRun:
    done: int = 0
    skipped: int = 0
    failed: int = 0
    resumed: int = 0
    generated_frames: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    writers: int = 0  # video writer processes the run used (0: the writer thread decodes and encodes)
    videos_made: int = 0  # by the writer processes or thread
    video_seconds: float = 0.0  # what making them took, summed over the processes (a bench's writer pace)
    engine_loop: dict | None = None  # vLLM: where the engine loop's time went (vllm_stream.LoopTimes.as_dict)


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
    frame_decoder=None,
    writers: int = 0,
) -> ScenarioRun:
    """Generate and write every pending scenario (of `only_ids`, when given: a data-parallel
    worker's share, whose skipped lines the parent records). KeyboardInterrupt stops generation;
    scenarios already finished are still written before it propagates. `overwrite` lets existing
    files be replaced and changed scenarios run again; `lock` False: the caller holds --out-dir
    (a data-parallel parent). `writers`: processes that decode and encode the videos (0: the
    writer thread does; the refiner, `frame_decoder`, always decodes in this process)."""
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
        # frame_decoder: Terra's video refiner (refiner.decoder.RefinerDecoder); default: the tokenizer, frame by frame.
        # The refiner decodes in a thread of this process (refiner.stage), never in writer processes: it was loaded
        # here before the engine (taking its share of the GPU then), a copy of its 1.5B-parameter UNet per process
        # would not fit beside vLLM, and its seconds of GPU work per window dwarf what the thread costs the engine loop.
        pool = None  # makes the videos: writer processes, or the refiner's stage (windows of several videos per call)
        if decode and pending:
            pool = start_pool(tokenizer, writers, VIDEO_FPS) if frame_decoder is None else frame_decoder.stage(VIDEO_FPS)
        run.writers = pool.size if isinstance(pool, WriterPool) else 0
        writer = _Writer(out_dir, (frame_decoder or tokenizer) if decode else None, log, run, on_written,
                         plan.replaceable, pool)
        clock = time.perf_counter()
        backlog_limit = max(WRITER_BACKLOG, max_rollouts)

        def sampling(s: Scenario) -> Sampling:
            return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s.seed)

        ahead: EncodeAhead | None = None

        def progress() -> None:
            writer.check()  # a dead writer ends the run now, not after the next scenario
            if ahead is not None:
                ahead.check()  # so does a context that could not be read or encoded
            on_progress(run, len(pending))

        def finished(key: str, tokens: np.ndarray) -> None:
            s = by_key[key]
            writer.put(s, tokens, time.perf_counter() - started[key])
            run.generated_frames += s.frames - s.context_frames

        from terra_cli.backends.driver import RolloutJob

        def job(s: Scenario, context: np.ndarray) -> RolloutJob:
            return RolloutJob(s.id, context, s.actions, s.frames, sampling(s))

        driver = backend.driver(max_rollouts)
        try:
            ahead = EncodeAhead(pending, tokenizer, job, ahead=max(ENCODE_BATCH, max_rollouts),
                                hold=lambda: writer.behind(backlog_limit))
            try:
                # A scenario's seconds count from when the engine takes it, not from its encoding.
                driver.run(ahead.feed, on_frame=lambda job, i, t: progress(),
                           on_done=lambda job, tokens: finished(job.key, tokens.copy()),
                           on_start=lambda job: started.__setitem__(job.key, time.perf_counter()))
            finally:
                ahead.stop()
                run.engine_loop = driver.loop.as_dict()
            ahead.check()
        except BaseException:
            writer.close(quiet=True)  # writes what is finished; the first error is the one reported
            raise
        finally:
            run.seconds = time.perf_counter() - clock
        writer.close()
        run.seconds = time.perf_counter() - clock
        if pool is not None:
            run.videos_made, run.video_seconds = pool.videos, pool.video_seconds
    return run


def log_skipped(file: ScenarioFile, log: ResultsLog) -> int:
    for problem in file.problems:
        log.add({"id": None, "line": problem.line, "status": "skipped", "reason": problem.message})
    return len(file.problems)


class _Writer:
    """A background thread that writes finished scenarios, decoding and encoding them itself or,
    with a `pool`, placing the mp4 bytes its processes make, in the order the scenarios finished.
    `put` never blocks (the engine loop calls it); admission asks `behind` or waits in
    `wait_for_room`. A scenario counts as written once its line is in the results log; if the log
    cannot be appended or a writer process dies, the thread stops, and every call here raises that
    error in the caller's thread."""

    def __init__(self, out_dir: Path, tokenizer, log: ResultsLog, run: ScenarioRun, on_written: Callable[[dict], None],
                 replaceable: Container[str] = (), pool: WriterPool | None = None):
        self.out_dir, self.tokenizer, self.log, self.run = out_dir, tokenizer, log, run
        self.on_written, self.replaceable, self.pool = on_written, replaceable, pool
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue()
        self.backlog = 0  # put and not yet written (or failed)
        self._room = threading.Condition()
        self.thread = threading.Thread(target=self._work, name="terra-scenario-writer", daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, scenario: Scenario, tokens: np.ndarray, seconds: float) -> None:
        self._check_alive()
        with self._room:
            self.backlog += 1
        self.queue.put((scenario, tokens, seconds))

    def behind(self, limit: int) -> bool:  # `limit` or more wait to be written
        self._check_alive()
        return self.backlog >= limit

    def wait_for_room(self, limit: int) -> None:  # until fewer than `limit` wait to be written
        with self._room:
            while self.behind(limit):
                self._room.wait(WAIT_SECONDS)

    def _check_alive(self) -> None:
        self.check()
        if not self.thread.is_alive():
            raise OutputError("the scenario writer stopped before every scenario was written")

    def close(self, quiet: bool = False) -> None:
        """Write what is queued and stop. Waits only while the writer makes progress; a second
        Ctrl-C or SIGTERM interrupts the wait (the writer processes are stopped either way).
        `quiet`: the caller is already raising."""
        try:
            self.queue.put(None)
            while self.thread.is_alive():
                self.thread.join(WAIT_SECONDS)
        finally:
            if self.pool is not None:
                self.pool.close()
        if not quiet:
            self.check()

    def _work(self) -> None:
        try:
            if self.pool is not None:  # the processes make the videos; this thread places them, in order
                write_in_order(self.pool, self.queue, self._write)
            else:
                while (item := self.queue.get()) is not None:
                    self._write(*item)
        except WriterDied as exc:
            self.error = WriterDied(f"{exc}; the run stopped with {self.run.done} scenario(s) written and recorded; "
                                    "run the same command again to resume")
        except BaseException as exc:  # handed to the main thread, which ends the run with it
            self.error = exc
        finally:
            with self._room:
                self._room.notify_all()  # an admission waiting for room learns the writer is gone

    def _write(self, scenario: Scenario, tokens: np.ndarray, seconds: float, video=None) -> None:
        making = self.pool is None and self.tokenizer is not None  # this thread decodes and encodes the video
        began = time.perf_counter()
        try:
            record = save_finished(self.out_dir, self.log, scenario, tokens, seconds,
                                   decoder=self.tokenizer if video is None else None, video=video,
                                   replaceable=self.replaceable)
        except NotRecorded as exc:
            raise OutputError(f"{exc}; the run stopped with {self.run.done} scenario(s) written and recorded"
                              f"{exc.dropped}; fix that, then run the same command again to resume") from exc
        if making:
            self.run.videos_made += 1
            self.run.video_seconds += time.perf_counter() - began
        if record["status"] == "done":
            self.run.done += 1
        else:
            self.run.failed += 1
            self.run.errors.append(f"{scenario.id}: {record['reason']}")
        with self._room:
            self.backlog -= 1
            self._room.notify_all()
        self.on_written(record)


class NotRecorded(OutputError):
    """The results log could not be appended; the scenario's files were removed (a re-run makes them)."""

    def __init__(self, message: str, dropped: str):
        super().__init__(message)
        self.dropped = dropped


def save_finished(out_dir: Path, log: ResultsLog, scenario: Scenario, tokens: np.ndarray, seconds: float, *,
                  decoder=None, video: bytes | Exception | None = None, replaceable: bool | Container[str] = (),
                  extra: dict | None = None) -> dict:
    """Write one finished scenario (its files atomically, then its results line) and return the
    line: what a single-engine run's writer and the Ray driver both do with a finished scenario.
    `video`: the mp4 already encoded (by a Ray engine or a writer process), or why that failed.
    Raises NotRecorded if the log fails."""
    written: list[str] = []
    common = {"id": scenario.id, "seed": scenario.seed, "line": scenario.line, "digest": scenario.digest}
    try:
        paths = write_scenario(out_dir, scenario, tokens, decoder, overwrite=replaceable, written=written, video=video)
    except Exception as exc:  # one scenario's failed write must not stop the others
        record = {**common, "status": "failed", "reason": " ".join(str(exc).split()), "paths": written}
    else:
        record = {**common, "status": "done", "frames": int(tokens.shape[0]), "seconds": round(seconds, 2),
                  "paths": paths}
    record.update(extra or {})
    try:
        log.add(record)
    except OutputError as exc:
        _remove(out_dir, written)  # not recorded: a re-run makes them again
        dropped = f" ({scenario.id}'s files, written but not recorded, were removed)" if written else ""
        raise NotRecorded(str(exc), dropped) from exc
    return record


def _remove(out_dir: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            (out_dir / name).unlink()


def write_scenario(out_dir: Path, scenario: Scenario, tokens: np.ndarray, tokenizer, *,
                   overwrite: bool | Container[str] = False, written: list[str] | None = None,
                   video: bytes | Exception | None = None) -> list[str]:
    """`{stem}.npy` (all frames' tokens) and, with a tokenizer or `video` bytes, `{stem}.mp4`; each
    atomic. An existing file is replaced only if `overwrite` is True or names it (`plan_outputs`
    says which); otherwise the write fails and nothing is replaced. `written` collects the names
    as they land. `video` an Exception: the video failed where it was made; it is raised after the
    tokens are written, as a decode failing here would be."""
    from terra_cli.media.atomic import atomic_path, atomic_save_npy
    from terra_cli.media.frames import write_video

    def may_replace(name: str) -> bool:
        return overwrite if isinstance(overwrite, bool) else name in overwrite

    written = [] if written is None else written
    stem = scenario.output_stem
    (out_dir / stem).parent.mkdir(parents=True, exist_ok=True)
    tokens_name = f"{stem}.npy"
    atomic_save_npy(out_dir / tokens_name, tokens.astype(np.int64), overwrite=may_replace(tokens_name))
    written.append(tokens_name)
    video_name = f"{stem}.mp4"
    if isinstance(video, Exception):
        raise video
    if video is not None:  # encoded elsewhere (a Ray engine, a writer process): placed as it is
        with atomic_path(out_dir / video_name, overwrite=may_replace(video_name)) as tmp, open(tmp, "wb") as f:
            f.write(video)
            f.flush()
            os.fsync(f.fileno())
        written.append(video_name)
        return [video_name, tokens_name]
    if tokenizer is None:
        return [tokens_name]
    write_video(out_dir / video_name, decode_frames(tokenizer, tokens, scenario.seed), fps=VIDEO_FPS,
                overwrite=may_replace(video_name))
    written.append(video_name)
    return [video_name, tokens_name]
