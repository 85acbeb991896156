"""One engine in a Ray actor: scenarios arrive as data, tokens and encoded videos go back.

The driver (`scenarios.ray_runner`) calls `generate` once per scenario and keeps several calls
open per actor; the actor runs them concurrently (a threaded actor), so every open call is a
rollout in the engine's batch. `generate` returns as soon as the rollout's tokens are done, its
video already handed to the writer; the driver then asks for the video with `video`. So a
rollout's place in the batch is free again when its tokens are, not when its video is written:
when a batch of equal-length rollouts finishes together, the next batch starts at once instead
of refilling at the writer's pace (the full-run timeline in benchmarks/README.md).

The stages are a single engine's (scenarios.runner): the calls hand their contexts to one intake
thread, which encodes them in batches ahead of the engine (`encoding.encode_batch`) and puts their
jobs into a `JobFeed`; one thread runs the backend's driver over that feed (backends/driver.py,
whatever the backend). Videos are decoded and encoded by the actor's own writers: by default
threads of the actor's process (`scenarios.local_writer`), or `--writers N` processes
(`scenarios.writers.WriterPool`); either decodes frames as they are made. With none (a CPU), the
calling threads decode them.
With `--decoder refiner`, the actor loads the refiner before its engine (as a single engine does)
and refines its own videos in a thread (`refiner.stage`): the windows of the videos its open calls
wait for share UNet calls. Either way the driver alone writes files.

Nothing here reads the scenario file or writes into the output folder: the actor needs no
filesystem shared with the driver, only the model (a hub id or the same path on every node).
An engine error, or a writer process that died, ends the actor's process, so Ray restarts it
with a fresh engine and writers, and the driver hands its unfinished scenarios out again.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from terra_cli.backends.driver import JobFeed, RolloutJob

from terra_cli.scenarios.fault_injection import wait_for_gate
from terra_cli.scenarios.job import ScenarioJob
from terra_cli.pipeline.video import VIDEO_FPS
from terra_cli.scenarios.spec import Scenario


@dataclass(frozen=True)
class EngineSpec:
    """What an actor loads: the job's engine settings, resolved where the actor runs."""

    job: ScenarioJob
    backend: str  # hf, vllm, or auto (resolved on the actor's node)
    device: str  # cpu or cuda
    needs_tokenizer: bool
    index: int = 0
    threads: int = 0  # CPU threads of a reference engine (0: torch's default)
    frame_delay: float = 0.0  # test knob: seconds slept after each frame (a deliberately slow engine)
    longest_frames: int = 0  # the longest scenario of the run (--max-rollouts auto sizes by it)
    failing_ids: frozenset = frozenset()  # test knob: scenarios this engine fails
    hold_videos: int = 0  # test knob: no video returns before the engine has generated this many frames
    probe_wakes: bool = False  # run a WakeProbe, reported with the loop's times (a bench reads it)
    fails_to_start: bool = False  # test knob: the constructor raises, as when vLLM refuses to start
    frame_gate: str = ""  # test knob: after each frame, wait until this file exists (fault_injection)
    rollouts: int = 0  # this engine's share of the run's rollouts (--max-rollouts even sizes it by them)


@dataclass
class ScenarioWork:
    """One scenario and its context, read by the driver: tokens (K, T) or RGB frames."""

    scenario: Scenario
    context_tokens: np.ndarray | None = None
    context_images: list[np.ndarray] | None = None


@dataclass
class Generated:
    """What `generate` returns: a rollout's tokens. When `video_follows`, its video is being made
    and `video(id)` returns it."""

    id: str
    tokens: np.ndarray  # (frames, T) int64, context included
    seconds: float  # from the engine taking the scenario to its last frame
    video_follows: bool


@dataclass
class Finished:
    """A scenario ready to write: its tokens, and its encoded .mp4 when the job decodes."""

    id: str
    tokens: np.ndarray
    video: bytes | None
    seconds: float


class _Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.tokens: np.ndarray | None = None
        self.error: BaseException | None = None
        self.frames = 0  # generated so far (progress)


class ScenarioEngine:
    """The actor's class (wrapped with `ray.remote` by the driver; plain Python to test)."""

    def __init__(self, spec: EngineSpec):
        import faulthandler

        # A native crash (a kernel library's segfault) then leaves every thread's Python stack in
        # the worker's log (Ray's worker-*.err) instead of an actor gone without a word.
        faulthandler.enable()
        if spec.fails_to_start:
            raise RuntimeError(f"engine {spec.index} cannot start (TERRA_RAY_TEST_START_FAIL)")
        from terra_cli.runtime import configure_vllm_env

        configure_vllm_env()  # before anything imports vLLM (a no-op for the reference backend's work)
        from terra_cli.pipeline.engine_request import resolve_backend_name

        job = spec.job
        self.spec = spec
        self.backend_name = resolve_backend_name(spec.backend)
        self.job = job if not spec.threads else _with_threads(job, spec.threads)
        from terra_cli.scenarios.job import load_job_engine

        refiners = []  # with --decoder refiner: this engine refines its own videos (refiner.stage)

        def take_refiner_share(tokenizer, options: dict) -> None:
            from terra_cli.refiner.decoder import engine_refiner

            refiners.append(engine_refiner(job.refiner, [spec.longest_frames or 25], tokenizer, options))

        loaded = load_job_engine(self.job, self.backend_name, spec.device, spec.needs_tokenizer, spec.longest_frames,
                                 take_refiner_share if job.refiner is not None else (lambda tokenizer, options: None),
                                 rollouts=spec.rollouts or None)
        self.engine, self.tokenizer = loaded.engine, loaded.tokenizer
        self.startup, self.in_flight = (loaded.ready.seconds, loaded.ready.startup), loaded.ready.in_flight
        self.codec = threading.Lock()  # the image tokenizer, shared by the calling threads
        from terra_cli.scenarios.job import job_writers
        from terra_cli.scenarios.writers import start_pool

        if refiners:
            self.pool = refiners[0].stage(VIDEO_FPS)
        else:
            self.pool = start_pool(self.tokenizer, job_writers(self.job, spec.device), VIDEO_FPS,
                                   in_flight=self.in_flight, frames=spec.longest_frames)

        # The writer (processes, or threads here) decodes a scenario's frames while it is generated.
        self.ahead_of_time = self.pool if hasattr(self.pool, "frame") else None  # not the refiner's stage
        self.waiters: dict[str, _Waiter] = {}
        self.videos: dict[str, object] = {}  # scenario -> its video's Future, or its tokens to decode in `video`
        self.lock = threading.Lock()
        self.frames = 0
        self.failure: BaseException | None = None
        from terra_cli.runtime import stagger_starts_asked

        self.driver = self.engine.driver(self.in_flight, stagger_starts=stagger_starts_asked())
        self.feed = JobFeed()
        self.intake: queue.SimpleQueue = queue.SimpleQueue()  # ScenarioWork from the calls, to encode
        # The intake's seconds encoding, and when its first in-flight count of jobs was fed (from the engine's
        # ready): how much of the time to a full batch is the encoder's, and how much the calls' arrival
        self.intake_times: dict = {"intake_encode_s": 0.0}
        self.intake_fed, self.intake_began = 0, time.perf_counter()
        from terra_cli.scenarios.encoding import cuda_device

        self.cuda_device = cuda_device()  # the intake thread encodes on this actor's GPU
        self.thread = threading.Thread(target=self._drive, name="terra-engine", daemon=True)
        self.thread.start()
        self.intake_thread = threading.Thread(target=self._take_in, name="terra-intake", daemon=True)
        self.intake_thread.start()
        from terra_cli.scenarios.wake_probe import WakeProbe

        # The host side's waits, reported with the engine loop's times (a thread waking every 5 ms: only when asked)
        self.wake_probe = WakeProbe() if spec.probe_wakes else None

    # -- called by the driver -------------------------------------------------------------

    def ready(self) -> dict:
        import ray

        from terra_cli.scenarios.writers import WriterPool

        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "backend": self.backend_name,
                "device": self.spec.device, "startup_s": self.startup[0], "startup": self.startup[1],
                "in_flight": self.in_flight, "writers": self.pool.size if isinstance(self.pool, WriterPool) else 0}

    def stats(self) -> dict:
        """Its counts and loop times, asked every tick by the driver; also where a writer or refiner
        stage that stopped on its own (a refiner whose compile failed at start, say) ends the actor
        at once, with that error, instead of at its first video minutes of tokens later."""
        self._fail_if_output_stopped()
        loop = {**self.driver.loop.as_dict(), **(self.wake_probe.as_dict() if self.wake_probe is not None else {})}
        if hasattr(self.pool, "decode_stats"):  # the in-process writer: its decode-ahead shares this process and GPU
            loop.update(self.pool.decode_stats())
        loop.update(self.intake_times)
        with self.lock:
            return {"frames": self.frames, "pending_frames": sum(w.frames for w in self.waiters.values()),
                    "engine_loop": loop}

    def generate(self, work: ScenarioWork) -> Generated:
        s = work.scenario
        if s.id in self.spec.failing_ids:
            raise RuntimeError(f"scenario {s.id} fails on purpose (TERRA_RAY_TEST_FAIL)")
        waiter = _Waiter()
        with self.lock:
            if self.failure is not None:
                raise RuntimeError(f"engine failed: {self.failure}")
            self.waiters[s.id] = waiter
        started = time.perf_counter()
        try:
            self.intake.put(work)
            waiter.event.wait()
        finally:
            with self.lock:
                self.waiters.pop(s.id, None)
        if waiter.error is not None:
            raise waiter.error
        seconds = time.perf_counter() - started
        video_follows = bool(self.job.decode and self.tokenizer is not None)
        if video_follows:
            self._start_video(s.id, waiter.tokens, s.seed)
        return Generated(s.id, waiter.tokens, seconds, video_follows)

    def _fail_if_output_stopped(self) -> None:
        from terra_cli.scenarios.writers import WriterDied

        try:
            if hasattr(self.pool, "check"):
                self.pool.check()
        except WriterDied as exc:  # every later video would fail too
            self._die_after_this_call(exc)
            raise

    def _die_after_this_call(self, exc: BaseException) -> None:
        """`_die` in a thread of its own: the call that found `exc` raises it to the driver first."""
        threading.Thread(target=self._die, args=(exc,), daemon=True).start()

    def video(self, key: str) -> bytes:
        """The encoded video of a scenario `generate` returned with `video_follows`; waits for the
        writer. VideoFailed is that scenario's failure (the driver retries it elsewhere)."""
        with self.lock:
            pending = self.videos.pop(key)
        if self.spec.hold_videos:
            self._hold_video(key)
        if isinstance(pending, np.ndarray):  # no writer (a CPU actor): decode its tokens in this calling thread
            from terra_cli.media.frames import video_bytes
            from terra_cli.scenarios.writers import decode_frames

            with self.codec:
                frames = decode_frames(self.tokenizer, pending)
            return video_bytes(frames, fps=VIDEO_FPS)
        from terra_cli.scenarios.writers import WriterDied

        try:
            return pending.result()
        except WriterDied as exc:  # every later video would fail too
            self._die_after_this_call(exc)
            raise

    # -- the intake and engine threads ----------------------------------------------------

    def _take_in(self) -> None:
        """Encode the calls' contexts in batches (what is waiting, up to ENCODE_BATCH) and feed
        their jobs to the engine: the engine's thread never tokenizes."""
        from terra_cli.scenarios.encoding import ENCODE_BATCH, encode_batch

        job = self.job
        try:
            if self.cuda_device is not None:  # a new thread starts on GPU 0, whatever this actor's engine uses
                import torch

                torch.cuda.set_device(self.cuda_device)
            while True:
                works = [self.intake.get()]
                while len(works) < ENCODE_BATCH:
                    try:
                        works.append(self.intake.get_nowait())
                    except queue.Empty:
                        break
                encoding = time.perf_counter()
                try:
                    contexts = encode_batch([(w.context_tokens, w.context_images) for w in works], self.tokenizer,
                                            self.codec)
                except Exception as exc:  # these scenarios' own failure (an unreadable image): the engine goes on
                    for w in works:
                        self._finish(w.scenario.id, None, RuntimeError(" ".join(f"{type(exc).__name__}: {exc}".split())))
                    continue
                finally:
                    self.intake_times["intake_encode_s"] += time.perf_counter() - encoding
                for w, context in zip(works, contexts):
                    s = w.scenario
                    self.feed.put(RolloutJob(s.id, context, s.actions, s.frames, replace(job.sampling, seed=s.seed)))
                self.intake_fed += len(works)
                if self.intake_fed >= self.in_flight and "intake_first_batch_fed_s" not in self.intake_times:
                    self.intake_times["intake_first_batch_fed_s"] = time.perf_counter() - self.intake_began
        except BaseException as exc:
            self._die(exc)

    def _drive(self) -> None:
        try:
            self.driver.run(self.feed, on_frame=self._frame_done, on_start=self._started,
                            on_done=lambda job, tokens: self._finish(job.key, np.asarray(tokens, dtype=np.int64).copy()),
                            on_error=lambda job, exc: self._finish(
                                job.key, None, RuntimeError(" ".join(f"{type(exc).__name__}: {exc}".split()))))
        except BaseException as exc:  # the engine is unusable
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail the open calls, then end the process, for Ray to restart the actor afresh."""
        with self.lock:
            self.failure = exc
            for waiter in self.waiters.values():
                waiter.error = RuntimeError(f"engine {self.spec.index} failed: {type(exc).__name__}: {exc}")
                waiter.event.set()
        time.sleep(0.5)  # let the failed calls' replies leave before the process goes
        os._exit(1)

    def _started(self, job: RolloutJob) -> None:
        if self.ahead_of_time is not None:
            self.ahead_of_time.open(job.key, job.context)

    def _frame_done(self, job: RolloutJob, index: int, tokens: np.ndarray) -> None:
        key = job.key
        if self.ahead_of_time is not None:
            self.ahead_of_time.frame(key, index, tokens)
        with self.lock:
            self.frames += 1
            waiter = self.waiters.get(key)
            if waiter is not None:
                waiter.frames += 1
        if self.spec.frame_delay:
            time.sleep(self.spec.frame_delay)
        if self.spec.frame_gate:
            wait_for_gate(self.spec.frame_gate)

    def _finish(self, key: str, tokens: np.ndarray | None, error: BaseException | None = None) -> None:
        if tokens is None and self.ahead_of_time is not None:
            self.ahead_of_time.drop(key)
        with self.lock:
            waiter = self.waiters.get(key)
        if waiter is not None:
            waiter.tokens, waiter.error = tokens, error
            waiter.event.set()

    def _hold_video(self, key: str, limit_s: float = 60.0) -> None:
        deadline = time.monotonic() + limit_s
        while self.frames < self.spec.hold_videos:
            if time.monotonic() > deadline:
                raise RuntimeError(f"video {key} held for {limit_s:.0f} s: the engine generated {self.frames} of "
                                   f"{self.spec.hold_videos} frames (TERRA_RAY_TEST_HOLD_VIDEOS)")
            time.sleep(0.02)

    def _start_video(self, key: str, tokens: np.ndarray, seed: int) -> None:
        # The writer processes or threads, or the refiner's stage (whose UNet calls take the
        # windows of several videos), start on it now; `video` collects it.
        pending = self.pool.submit(key, tokens, seed) if self.pool is not None else tokens
        with self.lock:
            self.videos[key] = pending


def _with_threads(job: ScenarioJob, threads: int) -> ScenarioJob:
    return replace(job, engine=replace(job.engine, threads=job.engine.threads or threads))
