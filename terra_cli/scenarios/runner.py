"""`run_scenarios`: every scenario of a file through one engine, resumable, writing as it goes.

Generation goes through the backend's driver (backends/driver.py: continuous batching on vLLM,
lockstep batches on the reference); contexts are read and encoded in batches by a thread, ahead of
the engine (`encoding.EncodeAhead`). Finished scenarios go to a background thread that
writes them, so the engine keeps stepping while a video is made. Frames are decoded while
their scenario is generated and the mp4 encoded once it is done: with `writers` > 0 in that many
writer processes (`scenarios.writers`), off this process's CUDA context and interpreter lock; with 0
in threads of this process (`scenarios.local_writer`). The writer thread places their bytes in order.
Either way this process is the only one that writes into the folder. Each
written scenario appends one line to `DIR/results.jsonl` (`scenarios.results`: id, status, seed, frames, seconds,
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
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Container

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError, OutputError
from terra_cli.pipeline.video import VIDEO_FPS
from terra_cli.runtime import stagger_starts_asked
from terra_cli.scenarios.outdir import (RESULTS_NAME, SHARD_RESULTS_GLOB, OutDirLock, check_out_dir,  # noqa: F401
                                        make_out_dir, plan_outputs, read_results, results_logs)
from terra_cli.scenarios.encoding import ENCODE_BATCH, EncodeAhead
from terra_cli.scenarios.fault_injection import injected_frame_delay, injected_writer_backlog
from terra_cli.scenarios.results import (NotRecorded, ResultsLog, completed_ids, log_skipped,  # noqa: F401
                                         save_finished, write_scenario)
from terra_cli.scenarios.spec import Scenario, ScenarioFile
from terra_cli.scenarios.writers import WriterDied, WriterPool, start_pool, write_in_order

# No new scenario starts while this many finished ones (or the rollouts in flight, if more) wait
# for the writer: tokens only, 0.2 MB for an ACT-Bench sample.
WRITER_BACKLOG = 64
WAIT_SECONDS = 0.2  # how often a held admission or close looks at whether the writer is still alive
LOG = logging.getLogger("terra.scenarios")  # what a user should see (the CLI prints it as its own lines)


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
    frames_decoded_late: int | None = None  # writer processes: frames not decoded ahead, while their scenario ran
    engine_loop: dict | None = None  # vLLM: where the engine loop's time went (backends.driver.LoopTimes.as_dict)
    # While the run goes: its engine loop so far, as `engine_loop` will be at its end (a bench logs it
    # each minute, so a run cut off by a time limit still says where its time went); None after
    loop_so_far: Callable[[], dict] | None = field(default=None, repr=False, compare=False)


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
    sampling: Sampling = Sampling(),
    on_progress: Callable[[ScenarioRun, int], None] = lambda run, total: None,
    on_written: Callable[[dict], None] = lambda record: None,
    only_ids: set[str] | None = None,
    results_name: str = RESULTS_NAME,
    decode: bool = True,
    overwrite: bool = False,
    lock: bool = True,
    frame_decoder=None,
    writers: int = 0,
    videos_at_end: bool = False,
) -> ScenarioRun:
    """Generate and write every pending scenario (of `only_ids`, when given: a data-parallel
    worker's share, whose skipped lines the parent records). KeyboardInterrupt stops generation;
    scenarios already finished are still written before it propagates. `overwrite` lets existing
    files be replaced and changed scenarios run again; `lock` False: the caller holds --out-dir
    (a data-parallel parent). `writers`: processes that decode and encode the videos (0: the
    writer thread does; the refiner, `frame_decoder`, always decodes in this process). `videos_at_end`
    (`ScenarioJob.videos_at_end`, with `writers` 0): every video decoded once the engine is done."""
    check_scenarios(file, skip_invalid)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    make_out_dir(out_dir)
    decode = decode and tokenizer is not None
    with OutDirLock(out_dir) if lock else contextlib.nullcontext():
        mine = file.scenarios if only_ids is None else [s for s in file.scenarios if s.id in only_ids]
        plan = plan_outputs(mine, out_dir, decode=decode, overwrite=overwrite, inputs=file.input_files())
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
            pool = (start_pool(tokenizer, writers, VIDEO_FPS, decode_after=videos_at_end, in_flight=max_rollouts,
                               frames=max(s.frames for s in pending))
                    if frame_decoder is None else frame_decoder.stage(VIDEO_FPS))
        decode_after = getattr(pool, "engine_finished", None) is not None  # (no pool of threads: nothing to hold)
        run.writers = pool.size if isinstance(pool, WriterPool) else 0
        writer = _Writer(out_dir, (frame_decoder or tokenizer) if decode else None, log, run, on_written,
                         plan.replaceable, pool)
        clock = time.perf_counter()
        backlog_limit = injected_writer_backlog() or max(WRITER_BACKLOG, max_rollouts)
        if decode_after:  # its backlog is every finished scenario until the engine is done: never a reason to hold
            backlog_limit = math.inf
        frame_delay = injected_frame_delay()


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

        # The writer (processes, or threads here) decodes a scenario's frames while it is generated: at the end
        # only its mp4 is left.
        ahead_of_time = pool if hasattr(pool, "frame") else None  # not the refiner's stage

        def start(job) -> None:
            started[job.key] = time.perf_counter()
            if ahead_of_time is not None:
                ahead_of_time.open(job.key, job.context)

        def frame_done(job, index: int, tokens: np.ndarray) -> None:
            if ahead_of_time is not None:
                ahead_of_time.frame(job.key, index, tokens)
            progress()
            if frame_delay:
                time.sleep(frame_delay)

        from terra_cli.backends.driver import RolloutJob

        def job(s: Scenario, context: np.ndarray) -> RolloutJob:
            return RolloutJob(s.id, context, s.actions, s.frames, replace(sampling, seed=s.seed))

        driver = backend.driver(max_rollouts, stagger_starts=stagger_starts_asked())
        try:
            ahead = EncodeAhead(pending, tokenizer, job, ahead=max(ENCODE_BATCH, max_rollouts),
                                hold=lambda: writer.behind(backlog_limit))
            feed = ahead.feed

            def loop_so_far() -> dict:
                return {**driver.loop.as_dict(), **{k: round(v, 2) for k, v in ahead.times.items()},
                        "feed_held_s": round(feed.held_seconds(), 2),
                        **(pool.decode_stats() if hasattr(pool, "decode_stats") else {})}

            run.loop_so_far = loop_so_far
            try:
                # A scenario's seconds count from when the engine takes it, not from its encoding.
                driver.run(feed, on_frame=frame_done, on_done=lambda job, tokens: finished(job.key, tokens.copy()),
                           on_start=start)
            finally:
                ahead.stop()
                held = writer.backlog  # (with --videos-at-end: every finished scenario, none written yet)
                if decode_after:  # (also after a failure: what finished is written, as without --videos-at-end)
                    pool.engine_done()
                run.loop_so_far = None
                run.engine_loop = loop_so_far()
            ahead.check()
            if decode_after and held:  # minutes of decoding and encoding with nothing generated: say so
                LOG.info(f"every scenario's tokens are made: writing the {held} video(s) now (--videos-at-end)")
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and writer.backlog:  # minutes with the refiner: say how to stop now
                LOG.info(f"interrupted: writing the {writer.backlog} finished scenario(s) first (Ctrl-C again "
                         "stops at once; a re-run makes the unwritten ones again)")
            writer.close(quiet=True)  # writes what is finished; the first error is the one reported
            raise
        finally:
            run.seconds = time.perf_counter() - clock
        writer.close()
        run.seconds = time.perf_counter() - clock
        if pool is not None:
            run.videos_made, run.video_seconds = pool.videos, pool.video_seconds
            run.frames_decoded_late = getattr(pool, "frames_decoded_late", None)
            if run.engine_loop is not None and hasattr(pool, "decode_stats"):  # after the writer's last decodes
                run.engine_loop.update(pool.decode_stats())
    return run


class _Writer:
    """A background thread that writes finished scenarios, decoding and encoding them itself or,
    with a `pool`, placing the mp4 bytes its processes make, in the order the scenarios finished.
    `put` never blocks (the engine loop calls it); admission asks `behind` (the job feed's hold). A scenario counts as written once its line is in the results log; if the log
    cannot be appended or a writer process dies, the thread stops, and every call here raises that
    error in the caller's thread."""

    def __init__(self, out_dir: Path, tokenizer, log: ResultsLog, run: ScenarioRun, on_written: Callable[[dict], None],
                 replaceable: Container[str] = (), pool: WriterPool | None = None):
        self.out_dir, self.tokenizer, self.log, self.run = out_dir, tokenizer, log, run
        self.on_written, self.replaceable, self.pool = on_written, replaceable, pool
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue()
        self.backlog = 0  # put and not yet written (or failed)
        self._backlog_lock = threading.Lock()
        self.thread = threading.Thread(target=self._work, name="terra-scenario-writer", daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, scenario: Scenario, tokens: np.ndarray, seconds: float) -> None:
        self._check_alive()
        with self._backlog_lock:
            self.backlog += 1
        self.queue.put((scenario, tokens, seconds))

    def behind(self, limit: int) -> bool:  # `limit` or more wait to be written
        self._check_alive()
        return self.backlog >= limit

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
        with self._backlog_lock:
            self.backlog -= 1
        self.on_written(record)


