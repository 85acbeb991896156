"""The server's one engine: every video job and session step is a `RolloutJob` on it.

The backend's driver (backends/driver.py, the same one every front-end uses) runs in a background
thread, fed by a `JobFeed`, so jobs and session steps join the running batch at the next engine
step. Video jobs wait in the service's own queue until fewer than `job_slots` are in the engine:
the remaining slots stay free for sessions, whose next frame must not wait behind a queue of long
videos; a session's step goes into the feed ahead of any video job waiting there.

Callbacks (`Handlers`) run on the engine thread: they must be quick (hand the work elsewhere).
The tokenizer (encode / decode) is used from one media thread only (`media`).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from terra_cli.backends.driver import JobFeed, RolloutJob
from terra_cli.streams import picture_stream_asked
from terra_cli.server.pictures import PictureBatcher


@dataclass
class Handlers:
    on_frame: Callable[[int, np.ndarray], None] = lambda index, tokens: None
    on_done: Callable[[np.ndarray], None] = lambda tokens: None
    on_cancelled: Callable[[], None] = lambda: None
    on_error: Callable[[BaseException], None] = lambda exc: None


@dataclass
class EngineStats:
    frames: int = 0
    started: float = field(default_factory=time.monotonic)
    busy_seconds: float = 0.0
    busy_since: float | None = None
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))  # frame times

    def frame(self) -> None:
        self.frames += 1
        self.recent.append(time.monotonic())

    def frames_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        return sum(1 for t in self.recent if now - t <= window) / window

    def utilisation(self) -> float:
        busy = self.busy_seconds + (time.monotonic() - self.busy_since if self.busy_since else 0.0)
        return busy / max(time.monotonic() - self.started, 1e-9)


class EngineService:
    """Owns the backend and the tokenizer; `submit` / `cancel` from any thread."""

    def __init__(self, backend, tokenizer, *, max_in_flight: int = 1, session_slots: int = 0, model_label: str = "",
                 owns_backend: bool = True, picture_batch: int = 1):
        self.backend, self.tokenizer, self.model_label = backend, tokenizer, model_label
        self.owns_backend = owns_backend  # False: someone else closes it (a test's shared engine)
        self.name = backend.name
        self.quantization = getattr(backend, "quantization", None)
        self.layout = backend.config.layout
        self.media = ThreadPoolExecutor(1, thread_name_prefix="terra-media")
        self.picture_batch = picture_batch  # --picture-batch: frames in every picture decode, padded
        self.pictures = PictureBatcher(self.media, self.decode)
        self._stream = None  # the pictures' CUDA stream (`_picture_stream`)
        self.picture_stream = picture_stream_asked()  # read once, at start-up: a bad value stops the server there
        self.stats = EngineStats()
        self.failure: BaseException | None = None
        self._lock = threading.Condition()
        self._handlers: dict[str, Handlers] = {}
        self._in_engine: set[str] = set()
        self._interactive: set[str] = set()  # session steps among them
        self._waiting_jobs: collections.deque[RolloutJob] = collections.deque()
        self._closing = False
        self.driver = backend.driver(max_in_flight)
        self.max_in_flight = self.driver.max_in_flight
        self.feed = JobFeed()
        self.job_slots = max(1, self.max_in_flight - session_slots)
        self.thread = threading.Thread(target=self._run, name="terra-engine", daemon=True)
        self.thread.start()

    # -- public -----------------------------------------------------------------------------

    def submit(self, job: RolloutJob, handlers: Handlers, *, interactive: bool = False) -> None:
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"the engine failed: {self.failure}")
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._handlers[job.key] = handlers
            if interactive:
                self._in_engine.add(job.key)
                self._interactive.add(job.key)
                self.feed.put(job, urgent=True)
            else:
                self._waiting_jobs.append(job)
                self._admit()
            self._lock.notify_all()

    def cancel(self, key: str) -> None:
        with self._lock:
            if key not in self._handlers:
                return
            queued = [j for j in self._waiting_jobs if j.key == key]
            if not queued:
                self.feed.cancel(key)  # the driver reports it (on_cancelled) once it drops it
                return
            for j in queued:
                self._waiting_jobs.remove(j)
            handlers = self._handlers.pop(key)
        handlers.on_cancelled()

    @property
    def queued_jobs(self) -> int:
        with self._lock:
            return len(self._waiting_jobs)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_engine)

    def close(self) -> None:
        """No more jobs; what is queued or in flight is cancelled; the engine is closed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            keys = list(self._handlers)
            self._lock.notify_all()
        for key in keys:
            self.cancel(key)
        self.feed.close()
        self.thread.join(timeout=60)
        self.media.shutdown(wait=True, cancel_futures=True)
        self.pictures.close()
        if self.owns_backend:
            self.backend.close()

    # -- media (one thread: the tokenizer is not shared between threads) -------------------

    def encode(self, images: list[np.ndarray]) -> np.ndarray:
        return self.tokenizer.tokenize(images)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        from tokenizer_decoder import ImageTokenizer

        if not isinstance(self.tokenizer, ImageTokenizer):
            return self.tokenizer.decode_tokens(tokens)
        # one batch size a server, padded: a session's picture is the same whatever was decoded with it
        # (kernels of another batch size may round differently); 1 by default, as a lone session asks for its
        # pictures one at a time (a padded batch of 8 cost 17 ms); 8 for many sessions, whose pictures then
        # take half the GPU time (32 sessions on an H100: 0.463 frames/s each against 0.415, 2026-12-07)
        with self._picture_stream():
            return self.tokenizer.decode_tokens(tokens, full_batches=True, batch_size=self.picture_batch)

    def _picture_stream(self):
        """On CUDA, by default a stream of its own of normal priority, the pictures' kernels beside the engine's
        decode steps (at 32 sessions faster than ahead of them, `streams.PICTURE_STREAM_ENV`, which may ask for
        one of high priority, or the engine's own)."""
        import contextlib

        import torch

        device = getattr(self.tokenizer, "device", None)
        if getattr(device, "type", None) != "cuda" or self.picture_stream == "shared":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device, priority=-1 if self.picture_stream == "high" else 0)
        return torch.cuda.stream(self._stream)

    def warm_up_pictures(self) -> float:
        """On CUDA, compile the tokenizer's decoder (`frame_store.compile_decoder`: full batches, Inductor's
        cache in terra's) and decode one batch, before the first session waits on it: eager, a picture took
        11 ms of the media thread, one after another, so a 32-session row batch's last picture came 0.36 s
        after its first (benchmarks/README.md). Seconds taken; 0.0 where nothing compiles."""
        return self.media.submit(self._warm_up_pictures).result()

    def _warm_up_pictures(self) -> float:
        from terra_cli.scenarios.frame_store import compile_decoder

        if not compile_decoder(self.tokenizer):
            return 0.0
        started = time.perf_counter()
        self.decode(np.zeros((1, self.layout.image_tokens), dtype=np.int64))
        return time.perf_counter() - started

    # -- the engine thread ------------------------------------------------------------------

    def _admit(self) -> None:
        """Hand queued video jobs to the driver while job slots are free (lock held)."""
        while self._waiting_jobs and len(self._in_engine - self._interactive) < self.job_slots:
            job = self._waiting_jobs.popleft()
            self._in_engine.add(job.key)
            self.feed.put(job)

    def _finish(self, key: str) -> Handlers | None:
        with self._lock:
            self._in_engine.discard(key)
            self._interactive.discard(key)
            handlers = self._handlers.pop(key, None)
            if not self._closing:
                self._admit()
            self._busy(bool(self._in_engine))
            return handlers

    def _busy(self, busy: bool) -> None:
        now = time.monotonic()
        if busy and self.stats.busy_since is None:
            self.stats.busy_since = now
        elif not busy and self.stats.busy_since is not None:
            self.stats.busy_seconds += now - self.stats.busy_since
            self.stats.busy_since = None

    def _on_frame(self, job: RolloutJob, index: int, tokens: np.ndarray) -> None:
        self.stats.frame()
        with self._lock:
            self._busy(True)
            handlers = self._handlers.get(job.key)
        if handlers is not None:
            handlers.on_frame(index, np.array(tokens))

    def _on_done(self, job: RolloutJob, tokens: np.ndarray) -> None:
        handlers = self._finish(job.key)
        if handlers is not None:
            handlers.on_done(np.array(tokens))

    def _on_cancelled(self, job: RolloutJob) -> None:
        handlers = self._finish(job.key)
        if handlers is not None:
            handlers.on_cancelled()

    def _on_error(self, job: RolloutJob, exc: BaseException) -> None:  # this job failed alone
        handlers = self._finish(job.key)
        if handlers is not None:
            handlers.on_error(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.failure = exc
            handlers = list(self._handlers.values())
            self._handlers.clear()
        for h in handlers:
            h.on_error(exc)

    def _run(self) -> None:
        try:
            with self._lock:
                self._busy(False)
            self.driver.run(self.feed, on_frame=self._on_frame, on_done=self._on_done,
                            on_cancelled=self._on_cancelled, on_error=self._on_error)
        except BaseException as exc:  # the engine thread must report, never die silently
            self._fail(exc)
