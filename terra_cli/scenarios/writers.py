"""Video writer processes for `--scenarios`: frames in as the engine makes them, mp4 bytes out.

`WriterPool` starts N processes (spawn context) that each load the image tokenizer once on the
run's device (`scenarios.writer_process`). A scenario's frames go to its process while it is
generated (`open`, `frame`): the process decodes them ahead, so when the scenario is done
(`submit`) only its last frame is left to decode and its mp4 to encode. The engine's process only
generates. It stays the only writer of files and of results.jsonl (`runner._Writer` places the
bytes with `write_scenario(video=...)`), so --out-dir's rules hold as they are: atomic files,
nothing replaced that the run may not replace, a scenario written once its line is in the log.

- A scenario belongs to one process (the one holding the fewest when it opens). Messages go
  through one sender thread, so `open`, `frame` and `drop` never block the engine's loop; tokens go
  as arrays, videos come back as bytes (pickled between these processes only: nothing read from
  disk is unpickled).
- A video that fails (a decode or encode error) comes back as that scenario's `VideoFailed`: the
  scenario is recorded failed, as a failed decode in the engine's process is.
- A worker that dies (killed, out of memory) or cannot load the tokenizer breaks the pool: every
  open video fails with one `WriterDied` naming it, and the run ends, waiting on no dead worker.
- Workers ignore Ctrl-C, SIGTERM and SIGHUP: on an interrupt the engine's process still writes
  the scenarios that finished, then closes the pool. A worker exits with the engine's process.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import signal
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

import numpy as np

from terra_cli.errors import OutputError
from terra_cli.scenarios.held_frames import HELD_FRAMES, held_frames_for
from terra_cli.scenarios.writer_process import SIGNALS, DecoderSpec, serve

ENCODERS_PER_PROCESS = 2  # mp4s a process encodes at once (ffmpeg processes of its own, on the host's cores)
OPEN_PER_PROCESS = 2 * ENCODERS_PER_PROCESS  # finished scenarios handed to the pool and not yet written, per process
GPU_WRITER_THREADS = 1  # torch CPU threads of a writer process that decodes on a GPU
POLL_SECONDS = 0.05  # how often write_in_order looks for a finished video while it also waits for new work
WAIT_SECONDS = 0.2  # how often it looks whether the pool broke while there is nothing to do
CLOSE_SECONDS = 10.0  # an idle worker told to stop exits well within this; one still busy is killed


def default_writers(device: str) -> int:
    """--writers auto: none, on a GPU as on a CPU: the engine's process decodes frames as they are made
    and encodes the mp4s in threads of its own (`local_writer.InProcessWriter`). On an H100 that
    generated 5% more frames than two writer processes beside vLLM (one CUDA context instead of three)
    and used 7 GB less of the card; either way the videos of a batch that finishes together are
    written in seconds, where one process decoding whole videos took 174 s (benchmarks/README.md).
    Processes remain for a host whose engine's interpreter is the bottleneck (`--writers N`)."""
    return 0


def decode_frames(decoder, tokens: np.ndarray, seed: int | None = None) -> list[np.ndarray]:
    """A scenario's frames from its tokens: the frame-wise tokenizer in full batches (the frames a
    writer process decodes ahead are the same), or a decoder that samples noise (`seeded`, the
    refiner) with the scenario's seed."""
    if getattr(decoder, "seeded", False):
        return list(decoder.decode_tokens(tokens, seed=seed))
    from tokenizer_decoder import ImageTokenizer

    if isinstance(decoder, ImageTokenizer):
        return list(decoder.decode_tokens(tokens, full_batches=True))
    return list(decoder.decode_tokens(tokens))


class WriterDied(OutputError):
    """A video writer process ended, or never started, while the run needed it."""


class VideoFailed(Exception):
    """One scenario's video could not be made in a writer process (the worker's message)."""


def start_pool(decoder, workers: int, fps: float, decode_after: bool = False, in_flight: int = 0, frames: int = 0):
    """What makes the videos of `decoder` (an image tokenizer): `workers` writer processes, or with 0
    (or a tokenizer a process cannot load from a folder) its threads in this process
    (`local_writer.InProcessWriter`); None for no decoder or another kind (the caller decodes).
    `decode_after` (`--videos-at-end`): the threads decode nothing until `engine_done`.
    `in_flight` rollouts of up to `frames` frames: what each keeps decoded ahead (`held_frames_for`)."""
    from tokenizer_decoder import ImageTokenizer

    if not isinstance(decoder, ImageTokenizer):
        return None
    held_frames = held_frames_for(in_flight, frames, tuple(decoder.image_size))
    if workers < 1 or DecoderSpec.of(decoder) is None:
        from terra_cli.scenarios.local_writer import InProcessWriter

        return InProcessWriter(decoder, fps, held_frames=held_frames, decode_after=decode_after)
    if decode_after:  # ScenarioJob refused --writers with --videos-at-end
        raise ValueError("decoding after the engine needs the engine's own writer threads, not writer processes")
    return WriterPool(decoder, workers, fps, held_frames=held_frames)


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
        self.keys: set[str] = set()  # scenarios it holds frames of or makes the video of
        self.open: dict[str, tuple[Future, float]] = {}  # finished scenarios it encodes: (future, when sent)


class WriterPool:
    """N writer processes. `open(key, context)` and `frame(key, index, tokens)` while a scenario is
    generated (optional: frames not sent are decoded at the end), `submit(key, tokens)` once it is
    done: a Future of the mp4 bytes (or raising VideoFailed for that scenario, WriterDied when the
    pool broke); `drop(key)` for one that will not finish. Call `close()` when done."""

    def __init__(self, tokenizer, workers: int, fps: float, encoders: int = ENCODERS_PER_PROCESS,
                 held_frames: int = HELD_FRAMES):
        import multiprocessing
        import torch

        if workers < 1:
            raise ValueError(f"a writer pool needs at least 1 process, got {workers}")
        fields = DecoderSpec.of(tokenizer)
        if fields is None:
            raise ValueError("this decoder cannot be loaded in a writer process (it has no checkpoint folder)")
        self.folder = tempfile.mkdtemp(prefix="terra-writers-")
        # On a GPU the decode needs no CPU threads of torch's: its 16 spun beside vLLM's engine on an H100 and
        # slowed its steps (benchmarks/README.md). On a CPU the engine process's count gives the same frames.
        threads = GPU_WRITER_THREADS if fields["device"].startswith("cuda") else torch.get_num_threads()
        # Each process holds the frames of its own videos only: the run's limit bounds every one of them
        spec = DecoderSpec(**fields, threads=threads, fps=fps, folder=self.folder, encoders=encoders,
                           held_frames=held_frames)
        self.lock = threading.Lock()
        self.failure: WriterDied | None = None
        self.closing = False
        self.outbox: deque[tuple[_Worker, object]] = deque()  # sent in order by the sender thread
        self.outbox_ready = threading.Condition(self.lock)
        self.owner: dict[str, _Worker] = {}
        self.workers: list[_Worker] = []
        self.threads: list[threading.Thread] = []
        self.videos, self.video_seconds = 0, 0.0  # answered videos, and their time from `submit` to the answer
        self.frames_decoded_late = 0  # frames of made videos that were not decoded ahead (decoded after `submit`)
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would join them
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked; the worker imports afresh
        try:
            with _signals_blocked():  # the worker starts with them blocked, then ignores them
                for index in range(workers):
                    parent, child = context.Pipe()
                    process = context.Process(target=serve, args=(child, spec), name=f"terra-video-writer-{index}",
                                              daemon=True)
                    process.start()
                    child.close()
                    self.workers.append(_Worker(process, parent))
            for target, name in ((self._collect, "terra-video-writers"), (self._send, "terra-video-writers-out")):
                self.threads.append(threading.Thread(target=target, name=name, daemon=True))
                self.threads[-1].start()
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

    def open(self, key: str, context: np.ndarray) -> None:
        """A scenario the engine took: its context frames (K, T) are decoded ahead."""
        self.frame(key, 0, context)

    def frame(self, key: str, index: int, tokens: np.ndarray) -> None:
        """Frame(s) `index`.. of scenario `key` (tokens (T,) or (n, T)), to decode ahead. Never blocks."""
        rows = np.array(tokens, dtype=np.int64, ndmin=2)
        with self.lock:
            if self.failure is None and not self.closing:
                self._post(self._owner(key), ("frames", key, index, rows))

    def drop(self, key: str) -> None:
        """Forget a scenario that will not be submitted (cancelled, failed): its frames are freed."""
        with self.lock:
            worker = self.owner.pop(key, None)
            if worker is not None:
                worker.keys.discard(key)
                if self.failure is None and not self.closing:
                    self._post(worker, ("drop", key))

    def submit(self, key: str, tokens: np.ndarray, seed: int | None = None) -> Future:  # (no noise: seed unused)
        future: Future = Future()
        with self.lock:
            if self.failure is not None or self.closing:
                future.set_exception(self.failure or WriterDied("the video writer processes were closed"))
                return future
            worker = self.owner.pop(key, None) or self._least_busy()
            worker.keys.discard(key)
            worker.open[key] = (future, time.perf_counter())
            self._post(worker, ("finish", key, np.ascontiguousarray(tokens, dtype=np.int64)))
        return future

    def close(self) -> None:
        """Stop every worker: idle ones are told to exit, busy or unstarted ones are killed (the
        work they held is not needed any more); remove the temporary folder. Safe to call twice."""
        atexit.unregister(self.close)
        with self.lock:
            self.closing = True
            idle = [w for w in self.workers if w.ready and not w.dead and not w.open]
            self._fail_open(WriterDied("the video writer processes were closed before this scenario was encoded"))
            self.outbox.clear()
            self.outbox_ready.notify_all()
        for w in idle:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)
        for w in self.workers:
            if w in idle:
                w.process.join(CLOSE_SECONDS)
            if w.process.is_alive():
                w.process.kill()  # SIGKILL: workers ignore SIGTERM
                w.process.join(CLOSE_SECONDS)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(CLOSE_SECONDS)
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- under self.lock ----------------------------------------------------------------------

    def _owner(self, key: str) -> _Worker:
        worker = self.owner.get(key)
        if worker is None:
            worker = self.owner[key] = self._least_busy()
            worker.keys.add(key)
        return worker

    def _least_busy(self) -> _Worker:
        live = [w for w in self.workers if not w.dead] or self.workers
        return min(live, key=lambda w: (len(w.keys) + len(w.open), self.workers.index(w)))

    def _post(self, worker: _Worker, message) -> None:
        self.outbox.append((worker, message))
        self.outbox_ready.notify_all()

    def _fail_open(self, error: BaseException) -> None:
        for w in self.workers:
            for future, _ in w.open.values():
                if not future.done():
                    future.set_exception(error)
            w.open.clear()

    def _break(self, error: WriterDied) -> None:
        if self.failure is None and not self.closing:
            self.failure = error
        self._fail_open(self.failure or error)

    # -- the sender and collector threads ------------------------------------------------------

    def _send(self) -> None:
        while True:
            with self.lock:
                self.outbox_ready.wait_for(lambda: self.outbox or self.closing or self.failure is not None)
                if self.closing or self.failure is not None:
                    return
                worker, message = self.outbox.popleft()
            if worker.dead:
                continue
            try:
                worker.conn.send(message)  # may wait while the worker loads its decoder; the engine does not
            except (OSError, ValueError):  # it died a moment ago: the collector reports how
                worker.dead = True

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
            elif message[1] in w.open:
                future, sent_at = w.open.pop(message[1])
                self.videos += 1
                self.video_seconds += time.perf_counter() - sent_at
                if kind == "done":
                    self.frames_decoded_late += message[3]
                    future.set_result(message[2])
                else:
                    future.set_exception(VideoFailed(message[2]))

    def _exited(self, w: _Worker) -> None:
        if not self.closing:  # (while closing, close() stops and reaps them)
            w.process.join(1.0)
            if w.process.exitcode is None:  # its pipe closed but it runs on: of no use now
                w.process.kill()
                w.process.join(1.0)
        with self.lock:
            w.dead = w.reaped = True
            if not self.closing:
                doing = f" while encoding {sorted(w.open)[0]}" if w.open else ""
                self._break(WriterDied(f"video writer process {w.process.pid} {_how(w.process.exitcode)}{doing}"))
            self.outbox_ready.notify_all()


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
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
