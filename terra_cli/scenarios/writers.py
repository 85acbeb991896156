"""Video writer processes for `--scenarios`: finished tokens in, mp4 bytes out.

`WriterPool` starts N processes (spawn context) that each load the image tokenizer once on the
run's device, decode a finished scenario's tokens and encode the mp4 `media.frames.write_video`
makes, and send the bytes back; the engine's process only generates. It stays the only writer of
files and of results.jsonl (`runner._Writer` places the bytes with `write_scenario(video=...)`),
so --out-dir's rules hold as they are: atomic files, nothing replaced that the run may not
replace, a scenario written once its line is in the log.

- Each worker has its own pipe and one task at a time; tokens go as arrays, videos come back as
  bytes (pickled between these processes only: nothing read from disk is unpickled).
- A task that fails (a decode or encode error) comes back as that scenario's `VideoFailed`: the
  scenario is recorded failed, as a failed decode in the engine's process is.
- A worker that dies (killed, out of memory) or cannot load the tokenizer breaks the pool: every
  open task fails with one `WriterDied` naming it, and the run ends, waiting on no dead worker.
- Workers ignore Ctrl-C, SIGTERM and SIGHUP: on an interrupt the engine's process still writes
  the scenarios that finished, then closes the pool. A worker exits with the engine's process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from terra_cli.errors import OutputError

OPEN_PER_PROCESS = 2  # scenarios handed to the pool and not yet written, per process (their mp4s wait in memory)
POLL_SECONDS = 0.05  # how often write_in_order looks for a finished video while it also waits for new work
WAIT_SECONDS = 0.2  # how often it looks whether the pool broke while there is nothing to do
CLOSE_SECONDS = 10.0  # an idle worker told to stop exits well within this; one still busy is killed
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def default_writers(device: str) -> int:
    """--writers auto: one process on a GPU, none on a CPU (a thread of the engine's process: the
    decode needs the cores that generate). One, because each holds a CUDA context and decoder
    beside vLLM's 85%, where the card is near its limit, and one keeps up: 0.91 s per ACT-Bench
    video against a sample every 1.6 s from the engine on an H100 (benchmarks/README.md)."""
    return 1 if str(device).startswith("cuda") else 0


def decode_frames(decoder, tokens: np.ndarray, seed: int | None = None) -> list[np.ndarray]:
    """A scenario's frames from its tokens: the frame-wise tokenizer, or a decoder that samples
    noise (`seeded`, the refiner) with the scenario's seed."""
    seeded = {"seed": seed} if getattr(decoder, "seeded", False) else {}
    return list(decoder.decode_tokens(tokens, **seeded))


class WriterDied(OutputError):
    """A video writer process ended, or never started, while the run needed it."""


class VideoFailed(Exception):
    """One scenario's video could not be made in a writer process (the worker's message)."""


@dataclass(frozen=True)
class DecoderSpec:
    """What a worker loads: the image tokenizer's folder and settings, as the engine's process has them."""

    source: str
    device: str
    batch_size: int
    image_size: tuple[int, int]
    threads: int  # torch CPU threads: the engine process's, so a decode on the CPU gives the same frames
    fps: float
    folder: str  # temporary mp4s (removed with the pool, also those of a killed worker)

    @staticmethod
    def of(tokenizer) -> dict | None:
        """The fields a worker needs from a loaded `ImageTokenizer`; None for a decoder that cannot
        be loaded again from a folder (random weights, the refiner)."""
        from tokenizer_decoder import ImageTokenizer

        if not isinstance(tokenizer, ImageTokenizer) or not tokenizer.source:
            return None
        return {"source": str(tokenizer.source), "device": str(tokenizer.device), "batch_size": tokenizer.batch_size,
                "image_size": tuple(tokenizer.image_size)}


def start_pool(decoder, workers: int, fps: float) -> "WriterPool | None":
    """`workers` writer processes for `decoder`, or None where there are none to start: 0 asked,
    no decoder, or one a process cannot load from a folder (the refiner stays in its process)."""
    if workers < 1 or decoder is None or DecoderSpec.of(decoder) is None:
        return None
    return WriterPool(decoder, workers, fps)


def write_in_order(pool, items: queue.Queue, write: Callable) -> None:
    """Take (scenario, tokens, seconds) from `items` until None, hand each to `pool` (or a RefineStage), and call
    `write(scenario, tokens, seconds, video)` in the order they came, `video` the mp4 bytes or that
    scenario's VideoFailed. At most OPEN_PER_PROCESS per process are open at once: when the
    processes fall behind, the rest wait in `items` (the run holds back new scenarios meanwhile).
    Raises WriterDied once the pool broke."""
    pending: deque = deque()  # (scenario, tokens, seconds, future of its mp4)
    closing = False
    while pending or not closing:
        if pending and (closing or len(pending) >= OPEN_PER_PROCESS * pool.size or pending[0][3].done()):
            scenario, tokens, seconds, future = pending.popleft()
            try:
                video = future.result()  # WriterDied (the pool broke) ends the run
            except VideoFailed as exc:  # this scenario's own failure: recorded failed, as a decode error in the thread is
                video = exc
            write(scenario, tokens, seconds, video)
            continue
        try:
            item = items.get(timeout=POLL_SECONDS if pending else WAIT_SECONDS)
        except queue.Empty:
            pool.check()  # a process that died while there was nothing to encode
            continue
        if item is None:
            closing = True
            continue
        scenario, tokens, seconds = item
        pending.append((scenario, tokens, seconds, pool.submit(scenario.id, tokens, scenario.seed)))


class _Worker:
    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.ready = False  # loaded its decoder and waits for tasks
        self.dead = False  # takes no more tasks (its pipe broke, or it could not start)
        self.reaped = False  # the collector saw it exit
        self.task: tuple[Future, str] | None = None  # (future, scenario id) while it works
        self.sent_at = 0.0  # when its task was sent


class WriterPool:
    """N writer processes. `submit(key, tokens)` returns a Future of the mp4 bytes (or raising
    VideoFailed for that scenario, WriterDied when the pool broke). Call `close()` when done."""

    def __init__(self, tokenizer, workers: int, fps: float):
        import multiprocessing
        import torch

        if workers < 1:
            raise ValueError(f"a writer pool needs at least 1 process, got {workers}")
        fields = DecoderSpec.of(tokenizer)
        if fields is None:
            raise ValueError("this decoder cannot be loaded in a writer process (it has no checkpoint folder)")
        self.folder = tempfile.mkdtemp(prefix="terra-writers-")
        spec = DecoderSpec(**fields, threads=torch.get_num_threads(), fps=fps, folder=self.folder)
        self.lock = threading.Lock()
        self.failure: WriterDied | None = None
        self.closing = False
        self.backlog: deque[tuple[Future, str, np.ndarray]] = deque()
        self.workers: list[_Worker] = []
        self.thread: threading.Thread | None = None
        self.videos, self.video_seconds = 0, 0.0  # answered tasks, and their time from send to answer
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would join them
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; the worker imports afresh
        try:
            with _signals_blocked():  # the worker starts with them blocked, then ignores them
                for index in range(workers):
                    parent, child = context.Pipe()
                    process = context.Process(target=_serve, args=(child, spec), name=f"terra-video-writer-{index}",
                                              daemon=True)
                    process.start()
                    child.close()
                    self.workers.append(_Worker(process, parent))
            self.thread = threading.Thread(target=self._collect, name="terra-video-writers", daemon=True)
            self.thread.start()
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self.workers)

    def check(self) -> None:
        """Raise the pool's failure (a worker that died or could not start), if any."""
        if self.failure is not None:
            raise self.failure

    def submit(self, key: str, tokens: np.ndarray, seed: int | None = None) -> Future:  # (no noise: seed unused)
        future: Future = Future()
        with self.lock:
            if self.failure is not None:
                future.set_exception(self.failure)
                return future
            self.backlog.append((future, key, np.ascontiguousarray(tokens)))
            self._dispatch()
        return future

    def close(self) -> None:
        """Stop every worker: idle ones are told to exit, busy or unstarted ones are killed (the
        work they held is not needed any more); remove the temporary folder. Safe to call twice."""
        atexit.unregister(self.close)
        with self.lock:
            self.closing = True
            idle = [w for w in self.workers if w.ready and not w.dead and w.task is None]
            self._fail_open(WriterDied("the video writer processes were closed before this scenario was encoded"))
            for w in idle:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(None)
        for w in self.workers:
            if w in idle:
                w.process.join(CLOSE_SECONDS)
            if w.process.is_alive():
                w.process.kill()  # SIGKILL: workers ignore SIGTERM
                w.process.join(CLOSE_SECONDS)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(CLOSE_SECONDS)
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- under self.lock ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        for w in self.workers:
            if not self.backlog:
                return
            if w.dead or not w.ready or w.task is not None:
                continue
            future, key, tokens = self.backlog.popleft()
            try:
                w.conn.send((key, tokens))
            except (OSError, ValueError):  # it died a moment ago: the collector reports how
                self.backlog.appendleft((future, key, tokens))
                w.dead = True
                continue
            w.task = (future, key)
            w.sent_at = time.perf_counter()

    def _fail_open(self, error: BaseException) -> None:
        for w in self.workers:
            if w.task is not None:
                future, _ = w.task
                w.task = None
                if not future.done():
                    future.set_exception(error)
        while self.backlog:
            future, _, _ = self.backlog.popleft()
            if not future.done():
                future.set_exception(error)

    def _break(self, error: WriterDied) -> None:
        if self.failure is None and not self.closing:
            self.failure = error
        self._fail_open(self.failure or error)

    # -- the collector thread ---------------------------------------------------------------

    def _collect(self) -> None:
        from multiprocessing.connection import wait

        try:
            while True:
                with self.lock:
                    live = [w for w in self.workers if not w.reaped]
                if not live:
                    return
                ready = set(wait([w.conn for w in live] + [w.process.sentinel for w in live]))
                for w in live:
                    message = None
                    if w.conn in ready:
                        with contextlib.suppress(EOFError, OSError):
                            message = w.conn.recv()
                    if message is not None:
                        self._handle(w, message)
                    elif w.conn in ready or w.process.sentinel in ready:
                        self._exited(w)
        except BaseException as exc:  # a bug here must not leave the writer waiting forever
            with self.lock:
                self._break(WriterDied(f"the video writer pool failed: {type(exc).__name__}: {exc}"))

    def _handle(self, w: _Worker, message: tuple) -> None:
        kind = message[0]
        with self.lock:
            if kind == "ready":
                w.ready = True
            elif kind == "failed":
                w.dead = True
                self._break(WriterDied(f"a video writer process could not start: {message[1]}"))
            elif w.task is not None:
                future, _ = w.task
                w.task = None
                self.videos += 1
                self.video_seconds += time.perf_counter() - w.sent_at
                if kind == "done":
                    future.set_result(message[2])
                else:
                    future.set_exception(VideoFailed(message[2]))
            self._dispatch()

    def _exited(self, w: _Worker) -> None:
        if not self.closing:  # (while closing, close() stops and reaps them)
            w.process.join(1.0)
            if w.process.exitcode is None:  # its pipe closed but it runs on: of no use now
                w.process.kill()
                w.process.join(1.0)
        with self.lock:
            w.dead = w.reaped = True
            if not self.closing:
                doing = f" while encoding {w.task[1]}" if w.task is not None else ""
                self._break(WriterDied(f"video writer process {w.process.pid} {_how(w.process.exitcode)}{doing}"))


def _how(code: int | None) -> str:
    if code is None or code >= 0:
        return "stopped answering" if code is None else f"exited with status {code}"
    name = {s.value: s.name for s in signal.Signals}.get(-code, f"signal {-code}")
    return f"was killed ({name}{', out of memory?' if name == 'SIGKILL' else ''})"


@contextlib.contextmanager
def _signals_blocked():
    """Block Ctrl-C, SIGTERM and SIGHUP in this thread while workers start: a child inherits the mask,
    so one during its start-up waits until it ignores them, instead of a traceback; this process gets them after."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# -- in the worker process ------------------------------------------------------------------------

def _serve(conn, spec: DecoderSpec) -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    _exit_with_parent()
    try:
        import torch

        from terra_cli.runtime import quiet_dependency_deprecations
        from tokenizer_decoder import ImageTokenizer

        quiet_dependency_deprecations()
        torch.set_num_threads(spec.threads)
        decoder = ImageTokenizer.from_pretrained(spec.source, device=spec.device, batch_size=spec.batch_size,
                                                 image_size=spec.image_size)
    except BaseException as exc:  # told to the engine's process, which ends the run with it
        _send(conn, ("failed", " ".join(f"{type(exc).__name__}: {exc}".split())))
        return
    from terra_cli.media.frames import video_bytes

    if not _send(conn, ("ready",)):
        return
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        key, tokens = task
        try:
            data = video_bytes(decode_frames(decoder, tokens), spec.fps, spec.folder)
        except Exception as exc:  # this scenario's failure: recorded as failed, the run goes on
            reply = ("error", key, str(exc))
        else:
            reply = ("done", key, data)
        if not _send(conn, reply):
            return


def _send(conn, message) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, ValueError):  # the engine's process is gone
        return False


def _exit_with_parent() -> None:
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="terra-parent-watch", daemon=True).start()
