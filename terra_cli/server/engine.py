"""The server's one engine: every video job and session step is a `RolloutJob` on it.

On vLLM one `StreamDriver` runs in a background thread, fed by a `JobFeed`, so jobs and session
steps join the running batch at the next engine step. Video jobs wait in the service's own queue
until fewer than `job_slots` are in the engine: the remaining slots stay free for sessions, whose
next frame must not wait behind a queue of long videos. The reference backend (hf) runs one
request at a time in a worker thread, session steps first.

Callbacks (`Handlers`) run on the engine thread: they must be quick (hand the work elsewhere).
The tokenizer (encode / decode) is used from one media thread only (`media`).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from terra_cli.backends.vllm_stream import RolloutJob


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


class _Cancelled(Exception):
    pass


class EngineService:
    """Owns the backend and the tokenizer; `submit` / `cancel` from any thread."""

    def __init__(self, backend, tokenizer, *, max_in_flight: int = 1, session_slots: int = 0, model_label: str = "",
                 owns_backend: bool = True):
        self.backend, self.tokenizer, self.model_label = backend, tokenizer, model_label
        self.owns_backend = owns_backend  # False: someone else closes it (a test's shared engine)
        self.name = getattr(backend, "name", "hf")
        self.layout = backend.config.layout
        self.media = ThreadPoolExecutor(1, thread_name_prefix="terra-media")
        self.stats = EngineStats()
        self.failure: BaseException | None = None
        self._lock = threading.Condition()
        self._handlers: dict[str, Handlers] = {}
        self._in_engine: set[str] = set()
        self._waiting_jobs: collections.deque[RolloutJob] = collections.deque()
        self._waiting_steps: collections.deque[RolloutJob] = collections.deque()  # hf only
        self._cancelled: set[str] = set()
        self._closing = False
        if self.name == "vllm":
            from terra_cli.backends.vllm_stream import JobFeed, StreamDriver

            self.driver = StreamDriver(backend, max_in_flight)
            self.max_in_flight = self.driver.max_in_flight
            self.feed = JobFeed()
            target = self._run_stream
        else:
            self.max_in_flight = 1
            target = self._run_reference
        self.job_slots = max(1, self.max_in_flight - session_slots)
        self.thread = threading.Thread(target=target, name="terra-engine", daemon=True)
        self.thread.start()

    # -- public -----------------------------------------------------------------------------

    def submit(self, job: RolloutJob, handlers: Handlers, *, interactive: bool = False) -> None:
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"the engine failed: {self.failure}")
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._handlers[job.key] = handlers
            if self.name == "vllm" and interactive:
                self._in_engine.add(job.key)
                self.feed.put(job)
            else:
                (self._waiting_steps if interactive else self._waiting_jobs).append(job)
                self._admit()
            self._lock.notify_all()

    def cancel(self, key: str) -> None:
        with self._lock:
            if key not in self._handlers:
                return
            queued = [j for j in self._waiting_jobs if j.key == key] + [j for j in self._waiting_steps if j.key == key]
            if queued:
                for q in (self._waiting_jobs, self._waiting_steps):
                    for j in [j for j in q if j.key == key]:
                        q.remove(j)
                handlers = self._handlers.pop(key)
            elif self.name == "vllm":
                self.feed.cancel(key)
                return
            else:
                self._cancelled.add(key)
                return
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
        if self.name == "vllm":
            self.feed.close()
        self.thread.join(timeout=60)
        self.media.shutdown(wait=True, cancel_futures=True)
        if self.owns_backend:
            self.backend.close()

    # -- media (one thread: the tokenizer is not shared between threads) -------------------

    def encode(self, images: list[np.ndarray]) -> np.ndarray:
        return self.tokenizer.tokenize(images)

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        return self.tokenizer.decode_tokens(tokens)

    # -- engine threads ---------------------------------------------------------------------

    def _admit(self) -> None:
        """Hand queued video jobs to the stream driver while job slots are free (lock held)."""
        if self.name != "vllm":
            return
        while self._waiting_jobs and sum(1 for k in self._in_engine if not k.startswith("s-")) < self.job_slots:
            job = self._waiting_jobs.popleft()
            self._in_engine.add(job.key)
            self.feed.put(job)

    def _finish(self, key: str) -> Handlers | None:
        with self._lock:
            self._in_engine.discard(key)
            self._cancelled.discard(key)
            handlers = self._handlers.pop(key, None)
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

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.failure = exc
            handlers = list(self._handlers.values())
            self._handlers.clear()
        for h in handlers:
            h.on_error(exc)

    def _run_stream(self) -> None:
        try:
            with self._lock:
                self._busy(False)
            self.driver.run(self.feed, on_frame=self._on_frame, on_done=self._on_done, on_cancelled=self._on_cancelled)
        except BaseException as exc:  # the engine thread must report, never die silently
            self._fail(exc)

    def _run_reference(self) -> None:
        from terra_cli.pipeline.rounds import generate_tokens

        while True:
            with self._lock:
                while not (self._waiting_steps or self._waiting_jobs or self._closing):
                    self._lock.wait()
                if self._closing and not (self._waiting_steps or self._waiting_jobs):
                    return
                job = (self._waiting_steps or self._waiting_jobs).popleft()
                self._in_engine.add(job.key)
                self._busy(True)

            def on_frame(index: int, tokens: np.ndarray, _job=job) -> None:
                with self._lock:
                    if _job.key in self._cancelled or self._closing:
                        raise _Cancelled
                self._on_frame(_job, index, np.asarray(tokens)[0])

            try:
                sampling = replace(job.sampling)
                tokens = generate_tokens(self.backend, job.context, job.actions, job.total_frames, sampling,
                                         on_frame=on_frame)[0]
            except _Cancelled:
                self._on_cancelled(job)
            except Exception as exc:  # a bad job fails alone
                handlers = self._finish(job.key)
                if handlers is not None:
                    handlers.on_error(exc)
            else:
                self._on_done(job, tokens)
