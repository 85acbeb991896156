"""`InProcessWriter`: the writer processes' work (`scenarios.writer_process`) in threads of the engine's process.

One thread decodes each scenario's frames as the engine makes them, on a CUDA stream of its own, and
a few encoder threads make the mp4s (each runs its own ffmpeg). It is what `--writers 0` runs.

Why a thread can beat processes on a GPU: terra runs vLLM in its own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so this decoder shares vLLM's CUDA context and its kernels
interleave with the engine's on the same card. Writer processes each have a context of their own, and
the card time-slices between contexts: on an H100 the engine made 19% fewer frames beside two of them
while the decoder itself needs about 10% of the card (benchmarks/README.md, issue 37). What a thread
costs instead is the interpreter lock: the decode's kernel launches and the encoders' pipe writes, and
a compile of the decoder, which a child process therefore does first (`decoder_compile_apart`).

Same interface as `writers.WriterPool` (`open`, `frame`, `drop`, `submit`, `check`, `close`, `size`,
`videos`, `video_seconds`, `frames_decoded_late`), so `write_in_order` and the Ray actor drive either.
A failure of the thread (out of memory) fails every open video with `WriterDied`, and the run ends.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Callable

import numpy as np

from terra_cli.errors import InputError, error_summary
from terra_cli.runtime import host_cores
from terra_cli.streams import decode_sms_asked, decode_stream_asked
from terra_cli.scenarios.decoder_compile_apart import start_decoder_compile_apart
from terra_cli.scenarios.held_frames import HELD_FRAMES
from terra_cli.scenarios.frame_store import FrameStore
from terra_cli.scenarios.writer_process import drive
from terra_cli.scenarios.writers import CLOSE_SECONDS, ENCODERS_PER_PROCESS, WriterDied

ENCODERS_IN_PROCESS = 2 * ENCODERS_PER_PROCESS  # the mp4s two writer processes would encode at once: the fewest
MAX_ENCODERS_IN_PROCESS = 4 * ENCODERS_IN_PROCESS
# The decoder's child compiles in ~31 s cold on an H200 (benchmarks/README.md, 2026-11-26); frames wait while it
# does, so one that takes ten times that is ended and the writer's thread compiles itself
DECODER_APART_TIMEOUT_S = 300.0
LOG = logging.getLogger("terra.writer")  # a lab switch's fallback: one line on stderr
CORES_PER_ENCODER = 4  # host cores for each mp4 encoded at once (x264 on 2 threads, niced)


def encoders_for_host(cores: int | None = None) -> int:
    """The mp4s an engine's process encodes at once: 4, more on a host with cores to spare (one per
    CORES_PER_ENCODER cores, at most 16).

    Why more than a steady run needs: a batch's videos end together (its rollouts started together),
    and then every one waits for an encoder. On 4 x H200 (64 cores) the last 256 videos of a run took
    43 s to encode on 4 threads after the last token, 9% of the run (benchmarks/README.md, issue 37).
    The encoders are ffmpeg processes at a lower CPU priority, so at the end of a batch, with a few
    engines on the host, they take the idle cores and not the engines' loop threads."""
    cores = host_cores() if cores is None else cores
    return min(MAX_ENCODERS_IN_PROCESS, max(ENCODERS_IN_PROCESS, cores // CORES_PER_ENCODER))


def tail_encoders_for_host(cores: int | None = None) -> int:
    """The mp4s encoded at once while the engine has nothing in flight (`writer_process.drive`): one per
    H264_THREADS cores (x264's threads per video), at least `encoders_for_host`, at most 16. On one
    H200 with 16 cores (2026-11-28) the last 256 videos of a run, all ending together, took 42 s on 4
    encoders after the last frame, 8% of the run, while the engine's loop needed no core."""
    from terra_cli.media.frames import H264_THREADS

    cores = host_cores() if cores is None else cores
    return min(MAX_ENCODERS_IN_PROCESS, max(encoders_for_host(cores), cores // H264_THREADS))


class InProcessWriter:
    def __init__(self, decoder, fps: float, encoders: int | None = None, held_frames: int = HELD_FRAMES,
                 tail_encoders: int | None = None, compile_apart: Callable | None = None, decode_after: bool = False):
        encoders = encoders_for_host() if encoders is None else encoders
        tail_encoders = max(encoders, tail_encoders_for_host() if tail_encoders is None else tail_encoders)
        self.decode_stream = decode_stream_asked()  # a bad value is one line now, not a failed thread later
        self.decode_sms = decode_sms_asked()
        if self.decode_sms is not None and self.decode_stream == "engine":
            raise InputError("TERRA_DECODE_SMS bounds the decoder's own stream: leave TERRA_DECODE_STREAM unset with it")
        self.decode_sms_error: str | None = None  # why the green context could not be made (then: an own stream)
        self.decoder, self.fps, self.encoders, self.tail_encoders = decoder, fps, encoders, tail_encoders
        # write_in_order keeps OPEN_PER_PROCESS * size finished videos open: one per encoder thread, twice
        self.size = max(1, tail_encoders // ENCODERS_PER_PROCESS)
        self.folder = tempfile.mkdtemp(prefix="terra-writers-")
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.unanswered: dict[str, tuple[Future, float]] = {}
        self.failure: WriterDied | None = None
        self.closing = False
        self.videos, self.video_seconds, self.frames_decoded_late = 0, 0.0, 0
        # Started now, after the engine is up (a child beside vLLM's memory profiling would shrink its KV
        # cache), so the decoder compiles while the first frames are made (decoder_compile_apart: why)
        self.apart = (compile_apart or start_decoder_compile_apart)(decoder)
        # decode_after (--videos-at-end): no frame held or decoded ahead, and finished videos wait
        # for `engine_done`; then they are decoded and encoded with the card and the cores to themselves
        self.engine_finished = threading.Event() if decode_after else None
        self.store = FrameStore(decoder, 0 if decode_after else held_frames,
                                before_first_decode=self._await_compile_apart)
        atexit.register(self.close)  # its temporary folder goes with the process (a Ray actor's, say)
        self.thread = threading.Thread(target=self._run, name="terra-video-writer", daemon=True)
        self.thread.start()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def decode_stats(self) -> dict:
        """The decode-ahead's batches and frames so far (`FrameStore.stats`), and with TERRA_DECODE_SMS
        the SMs it was bounded to (or why it could not be)."""
        stats = self.store.stats()
        if self.apart is not None:  # the child's seconds, None while it runs or if it failed
            stats["decoder_compiled_apart_s"] = self.apart.succeeded_seconds
        if self.decode_sms is not None:
            stats.update(decode_sms=self.decode_sms, decode_sms_error=self.decode_sms_error)
        if self.engine_finished is not None:  # --videos-at-end: a bench's JSON says the run was one
            stats["decode_after"] = True
        return stats

    def open(self, key: str, context: np.ndarray) -> None:
        self.frame(key, 0, context)

    def frame(self, key: str, index: int, tokens: np.ndarray) -> None:
        if self.failure is None and not self.closing:
            self.inbox.put(("frames", key, index, np.array(tokens, dtype=np.int64, ndmin=2)))

    def drop(self, key: str) -> None:
        if self.failure is None and not self.closing:
            self.inbox.put(("drop", key))

    def submit(self, key: str, tokens: np.ndarray, seed: int | None = None) -> Future:  # (no noise: seed unused)
        future: Future = Future()
        with self.lock:
            if self.failure is not None or self.closing:
                future.set_exception(self.failure or WriterDied("the video writer was closed"))
                return future
            self.unanswered[key] = (future, time.perf_counter())
        self.inbox.put(("finish", key, np.ascontiguousarray(tokens, dtype=np.int64)))
        return future

    def engine_done(self) -> None:
        """The engine made its last frame for this writer: with decode_after, the videos wait no more."""
        if self.engine_finished is not None:
            self.engine_finished.set()
            self.inbox.put(("engine done",))  # wakes the loop

    def close(self) -> None:
        """Let the videos being encoded finish (the run waited for the ones it needs), then stop. Safe to call twice."""
        atexit.unregister(self.close)
        self.engine_done()  # (a run that failed: what finished is still written)
        with self.lock:
            self.closing = True
        if self.apart is not None:  # a run that ended before its first decode: the thread waiting on it goes on
            self.apart.stop()
        self.inbox.put(None)
        self.thread.join(CLOSE_SECONDS)
        with self.lock:
            self._fail_open(WriterDied("the video writer was closed before this scenario was encoded"))
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self) -> None:
        try:
            with self._own_stream():
                drive(self.inbox, self.store, self._answer, self.fps, self.folder, self.encoders,
                      self.tail_encoders, engine_done=self.engine_finished)
        except BaseException as exc:  # out of memory, a bug: the run ends with it, resumable
            with self.lock:
                self.failure = WriterDied(f"the video writer thread failed: {type(exc).__name__}: {exc}")
                self._fail_open(self.failure)

    def _await_compile_apart(self) -> bool:
        """Before the first decode: wait for the child compiling the decoder (no interpreter lock held
        while waiting), so the compile that follows comes from Inductor's cache; if it failed, one line.
        False when close() ended it: then the thread decodes nothing ahead (it would compile, to no use)."""
        apart = self.apart
        if apart is None:
            return True
        result = apart.wait(DECODER_APART_TIMEOUT_S)
        if self.closing:  # ended by close(): nothing to say
            return False
        if result is not None:
            LOG.info(f"the tokenizer's decoder: compiled apart in {apart.seconds:.1f} s ({apart.settings_note()}); "
                     "compiling here from Inductor's cache")
        else:
            LOG.warning(apart.failure_line("the tokenizer's decoder"))
        return True

    def _own_stream(self):
        """A CUDA stream of this thread's own, so its kernels can run beside the engine's; with
        TERRA_DECODE_STREAM=engine (a lab switch), the device's default stream, the one vLLM steps on
        unless TERRA_ENGINE_STREAM_PRIORITY moved it: the decoder's kernels then wait in line behind
        the engine's instead of sharing the SMs with them. Beside them, the engine's steps ran 17%
        slower (4 x H200, 2026-11-27), more than the decoder's own ~7% of the card."""
        device = getattr(self.decoder, "device", None)
        if getattr(device, "type", None) != "cuda":
            return contextlib.nullcontext()
        import torch

        if self.decode_stream == "engine":
            return torch.cuda.stream(torch.cuda.default_stream(device))
        if self.decode_sms is not None:
            try:
                return GreenContextScope(device, self.decode_sms)
            except Exception as error:  # noqa: BLE001 - no green contexts in this torch or driver: the plain stream is correct too
                self.decode_sms_error = error_summary(error)
                LOG.warning(f"TERRA_DECODE_SMS={self.decode_sms}: no green context ({self.decode_sms_error}); "
                            "the decoder uses a stream of its own on every SM")
        return torch.cuda.stream(torch.cuda.Stream(device))

    def _answer(self, message: tuple) -> None:
        with self.lock:
            entry = self.unanswered.pop(message[1], None)
            if entry is None:
                return
            future, sent_at = entry
            self.videos += 1
            self.video_seconds += time.perf_counter() - sent_at
            if message[0] == "done":
                self.frames_decoded_late += message[3]
        if message[0] == "done":
            future.set_result(message[2])
        else:
            from terra_cli.scenarios.writers import VideoFailed

            future.set_exception(VideoFailed(message[2]))

    def _fail_open(self, error: BaseException) -> None:
        for future, _ in self.unanswered.values():
            if not future.done():
                future.set_exception(error)
        self.unanswered.clear()


class GreenContextScope:
    """Inside `with`, the calling thread's CUDA work runs on a stream bounded to `sms` of the card's
    SMs: a CUDA green context's (torch.cuda.green_contexts, beta; CUDA 12.4 or later). Tensors stay
    usable across it and the engine's streams (one device, one address space). torch 2.12 on hands
    out the context's own stream (`Stream()`). torch 2.10 and 2.11 have none, and a stream from
    torch's pool made while the context is current is not the context's (the pool's streams were made
    once, in the primary context), nor is the context's default stream safe (a blocking stream would
    wait for the engine's work on the legacy default stream): there the driver makes a non-blocking
    stream while the context is current, which belongs to it. The context lives as long as this
    object: destroying it would end its stream. Made eagerly: where torch or the driver has no green
    contexts, the constructor raises."""

    def __init__(self, device, sms: int):
        import torch
        from torch.cuda.green_contexts import GreenContext

        from terra_cli.runtime import cuda_index

        index = cuda_index(device)
        if torch.cuda.is_available():  # a new thread has no current context: torch would warn and make one
            torch.cuda.set_device(index)
        self.context = GreenContext.create(num_sms=sms, device_id=index)
        if hasattr(self.context, "Stream"):
            self.stream = self.context.Stream()
        else:
            self.context.set_context()
            try:
                self.stream = driver_stream_of_current_context(index)
            finally:
                self.context.pop_context()
        self._block = None

    def __enter__(self):
        import torch

        self._block = torch.cuda.stream(self.stream)
        return self._block.__enter__()

    def __exit__(self, *exc_info):
        block, self._block = self._block, None
        return block.__exit__(*exc_info)


CU_STREAM_NON_BLOCKING = 1  # cuda.h: no implicit wait for the legacy default stream


def driver_stream_of_current_context(index: int):
    """A non-blocking stream of the thread's current CUDA context (cuStreamCreate), as a torch stream."""
    import ctypes

    import torch

    handle = ctypes.c_void_p()
    result = ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
    if result != 0:
        raise RuntimeError(f"cuStreamCreate returned CUresult {result}")
    return torch.cuda.ExternalStream(handle.value, device=index)
