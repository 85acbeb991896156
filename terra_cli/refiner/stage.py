"""`RefineStage`: the refiner as a stage of a scenario run, windows of several videos per UNet call.

Finished token videos come in (`submit(key, tokens, seed)`), encoded mp4s go out (a Future per
video), like `scenarios.writers.WriterPool`, so `scenarios.writers.write_in_order` drives either
one and the run's writer thread (or a Ray engine's calls) stays the only writer of files. One
thread does the GPU work in this process (one copy of the refiner beside the engine):

- a video that comes in is decoded by the token decoder and VAE-encoded into its concat condition,
  and its windows, each with its own seeded noise (`VideoRefiner.windows`), join a queue;
- each UNet batch takes up to `batch_windows` windows from that queue, of whichever videos they
  come from (`VideoRefiner.sample_windows`; a compiled UNet gets exactly that many, padded);
- once a video's windows are all sampled, its latents are decoded frame by frame, and its mp4 is
  encoded in one of ENCODERS threads of the stage: ffmpeg's work is the host's, and done on this
  thread it left the GPU idle for the refiner (on an H200, 2026-11-29, the product's thread was busy
  4.49 s a 47-frame video against 3.44 s for its UNet and VAE alone, benchmarks/README.md).

New videos are taken in between UNet batches, so windows of videos that finish while one batch
runs share the next. A video's result does not depend on which others share its calls (its noise
is its own; kernels at another batch size round differently, within float rounding).

A video whose tokens cannot be decoded or whose mp4 cannot be made fails alone (`VideoFailed`);
a UNet batch that fails (out of memory, a compile error) stops the stage: every open video fails
with `RefinerStopped` (a `WriterDied`: the run ends, resumable), and so does every later one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from terra_cli.scenarios.writers import ENCODERS_PER_PROCESS, VideoFailed, WriterDied

CLOSE_SECONDS = 10.0  # close() waits this long for a UNet batch in progress; the thread is a daemon
# A cold compile apart took 166 s (UNet) + 62 s (VAE decoder) on an H200 (benchmarks/README.md, 2026-11-28);
# finished videos wait for it, so a child still compiling after this long is ended and the stage compiles itself
REFINER_APART_TIMEOUT_S = 1800.0
ENCODERS = ENCODERS_PER_PROCESS  # mp4s encoded at once beside the stage's GPU thread, as a writer process does


class RefinerStopped(WriterDied):
    """The refiner stage failed or was closed while videos waited for it."""


@dataclass
class _Video:
    key: str
    future: Future
    submitted: float
    windows_left: int = 0
    latents: list = field(default_factory=list)  # (index, latents) as windows finish


class RefineStage:
    """`decoder` a `refiner.decoder.RefinerDecoder`; `finish(frames)` turns a video's refined uint8
    frames into what its Future gives (default: the frames). Call `close()` when done."""

    def __init__(self, decoder, finish: Callable[[np.ndarray], object] = lambda frames: frames,
                 compile_apart: Callable | None = None):
        self.decoder, self.refiner, self.finish = decoder, decoder.refiner, finish
        self.windows_per_call = self.refiner.options.batch_windows
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque = deque()  # (video, Window) in the order they came
        self.open: dict[int, _Video] = {}  # by submission number
        self.lock = threading.Lock()
        self.failure: RefinerStopped | None = None
        self.closed = False
        self.stopping = threading.Event()
        self.videos, self.video_seconds = 0, 0.0  # made, and their time from submission to the mp4
        self.unet_batches = 0
        self.compile_cache: tuple[int, int] | None = None  # Inductor's FX-graph cache (hits, misses) of its compile
        # The GPU thread's seconds on videos, compiling not included, by part: taking videos in (the token
        # decoder and the VAE's encoder), UNet batches, the VAE's decoder; and its seconds waiting for videos
        # while no window was left. The mp4s' seconds are the encoder threads'. Taking in launches GPU work that
        # the next part's copy to the host waits for, so these split the thread's time, not the GPU's.
        self.take_in_s = self.unet_s = self.vae_decode_s = self.starved_s = self.mp4_s = 0.0
        # When its first UNet batch began (after the compile) and its last mp4 was made: the refiner's own
        # pace on the wall, one-time waits left out (the 2026-11-29 lease read it off the GPU timeline)
        self.first_batch_at: float | None = None
        self.last_video_at: float | None = None
        self.encoders = ThreadPoolExecutor(ENCODERS, thread_name_prefix="terra-refiner-mp4")
        self._count = 0
        from terra_cli.refiner.compile_apart import start_compile_apart
        from terra_cli.runtime import cuda_index

        self.cuda_index = cuda_index(self.refiner.target_device)  # here: the stage's thread starts on GPU 0
        # Started here, so it compiles while the engine makes the first videos (compile_apart's docstring: why)
        self.apart = (compile_apart or start_compile_apart)(self.refiner)
        self.thread = threading.Thread(target=self._run, name="terra-refiner", daemon=True)
        self.thread.start()

    @property
    def size(self) -> int:
        """How many videos `write_in_order` keeps open per OPEN_PER_PROCESS: enough for full batches."""
        return self.windows_per_call

    def submit(self, key: str, tokens: np.ndarray, seed: int = 0) -> Future:
        future: Future = Future()
        with self.lock:
            if self.failure is not None or self.closed:
                future.set_exception(self.failure or RefinerStopped("the refiner was closed"))
                return future
            self._count += 1
            self.inbox.put((self._count, _Video(key, future, time.perf_counter()), np.ascontiguousarray(tokens),
                            int(seed)))
        return future

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    @property
    def busy_s(self) -> float:
        """The GPU thread's seconds on videos (its parts summed), compiling and waiting not included."""
        return self.take_in_s + self.unet_s + self.vae_decode_s

    @property
    def wall_s(self) -> float | None:
        """Wall seconds from its first UNet batch to its last finished video (None before one)."""
        if self.first_batch_at is None or self.last_video_at is None:
            return None
        return round(max(0.0, self.last_video_at - self.first_batch_at), 3)

    def decode_stats(self) -> dict:
        """What the stage did so far, reported with its engine loop's times (as a writer's
        decode-ahead is): videos refined, the GPU thread's busy seconds on them and their parts, its
        seconds waiting for videos, the encoder threads' mp4 seconds, UNet batches, and the compile mode
        and seconds of the UNet and the VAE decoder (0 when eager; from Inductor's cache when compiled
        apart first: that child's seconds, None when there was none or it failed)."""
        refiner, apart = self.refiner, self.apart
        return {"refiner_compiled_apart_s": None if apart is None else apart.succeeded_seconds, "refined_videos": self.videos,
                "refiner_busy_s": round(self.busy_s, 3), "refiner_take_in_s": round(self.take_in_s, 3),
                "refiner_unet_s": round(self.unet_s, 3), "refiner_vae_decode_s": round(self.vae_decode_s, 3),
                "refiner_starved_s": round(self.starved_s, 3), "refiner_mp4_s": round(self.mp4_s, 3),
                "refiner_unet_batches": self.unet_batches, "refiner_wall_s": self.wall_s,
                "refiner_compile_mode": refiner.compile_mode,
                "refiner_compile_s": round(refiner.compile_seconds, 2),
                "refiner_vae_compile_s": round(refiner.vae_decoder_compile_seconds, 2),
                "refiner_compile_cache": None if self.compile_cache is None else list(self.compile_cache)}

    def close(self) -> None:
        """Stop after the UNet batch in progress; videos still open fail. Safe to call twice."""
        with self.lock:
            self.closed = True
        self.stopping.set()
        if self.apart is not None:
            self.apart.stop()
        self.inbox.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(CLOSE_SECONDS)
        self.encoders.shutdown(wait=False, cancel_futures=True)  # an mp4 still encoding ends with its ffmpeg
        with self.lock:
            self._fail_open(self.failure or RefinerStopped("the refiner was closed before this video was refined"))

    # -- the stage's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._on_device()
            while not self.stopping.is_set():
                if not self._take_in(block=not self.waiting):
                    continue
                group = [self.waiting.popleft() for _ in range(min(self.windows_per_call, len(self.waiting)))]
                if group:
                    self._sample(group)
        except BaseException as exc:  # the stage cannot go on: every open and later video fails
            with self.lock:
                self.failure = RefinerStopped(f"the refiner stopped: {type(exc).__name__}: {' '.join(str(exc).split())}")
                self._fail_open(self.failure)

    def _on_device(self) -> None:
        """This thread uses the refiner's GPU: it waits for the compile apart (the engine generates
        meanwhile), moves the weights there, and compiles the UNet and the VAE decoder, from
        Inductor's cache when the child filled it, else here beside the engine."""
        if self.apart is not None:
            self._wait_for_compile_apart()
        if self.stopping.is_set():
            return
        if self.cuda_index is not None:
            import torch

            torch.cuda.set_device(self.cuda_index)
        self.refiner.to(self.refiner.target_device)
        from terra_cli.compile_apart import fx_cache_counts

        before = fx_cache_counts()
        self.refiner.prepare()
        self.refiner.prepare_vae_decoder()
        after = fx_cache_counts()
        self.compile_cache = (after[0] - before[0], after[1] - before[1])  # the compile apart's test: misses 0

    def _wait_for_compile_apart(self) -> None:
        from terra_cli.refiner.refiner import LOG

        apart = self.apart
        result = apart.wait(REFINER_APART_TIMEOUT_S)
        if self.stopping.is_set():
            return
        if result is None:
            LOG.warning(apart.failure_line("refiner"))
            return
        LOG.info(f"refiner: compiled apart in {apart.seconds:.1f} s (UNet {result.get('unet_s')} s, VAE decoder "
                 f"{result.get('vae_decoder_s')} s, in a child process while the engine generated; "
                 f"{apart.settings_note()}); "
                 f"compiling here from Inductor's cache")

    def _take_in(self, block: bool) -> bool:
        """Turn what came in into windows; False once told to stop."""
        while True:
            waited = time.perf_counter()
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return True
            finally:
                if block and self.videos + len(self.open) > 0:  # not the wait for the run's first video
                    self.starved_s += time.perf_counter() - waited
            if item is None:
                return False
            block = False
            number, video, tokens, seed = item
            started = time.perf_counter()
            try:
                pixels = self.decoder.token_frames(tokens)
                windows = self.refiner.windows(self.refiner.condition_latents(pixels), seed, number)
            except Exception as exc:  # this video's own failure (tokens its decoder cannot take)
                self._answer(number, video, error=exc)
                continue
            finally:
                self.take_in_s += time.perf_counter() - started
            video.windows_left = len(windows)
            with self.lock:
                self.open[number] = video
            self.waiting.extend(windows)

    def _sample(self, group: list) -> None:
        started = time.perf_counter()
        if self.first_batch_at is None:
            self.first_batch_at = started
        latents = self.refiner.sample_windows(group)
        self.unet_s += time.perf_counter() - started
        self.unet_batches += 1
        for window, kept in zip(group, latents):
            video = self.open.get(window.video)
            if video is None:  # failed by close() while this batch ran
                continue
            video.latents.append((window.index, kept))
            video.windows_left -= 1
            if video.windows_left == 0:
                self._decode(window.video, video)

    def _decode(self, number: int, video: _Video) -> None:
        """Its latents to frames here (the GPU's work), then its mp4 in an encoder thread; it stays
        open (close() fails it) until the mp4 is made."""
        import torch

        started = time.perf_counter()
        try:
            latents = torch.cat([z for _, z in sorted(video.latents, key=lambda item: item[0])])
            frames = self.refiner.decode(latents)
        except Exception as exc:
            self._answer(number, video, error=exc)
            return
        finally:
            self.vae_decode_s += time.perf_counter() - started
        self.encoders.submit(self._encode, number, video, frames)

    def _encode(self, number: int, video: _Video, frames: np.ndarray) -> None:
        started = time.perf_counter()
        try:
            result = self.finish(frames)
        except Exception as exc:
            self._answer(number, video, error=exc, seconds=time.perf_counter() - started)
        else:
            self._answer(number, video, result=result, seconds=time.perf_counter() - started)

    def _answer(self, number: int, video: _Video, result=None, error: Exception | None = None,
                seconds: float = 0.0) -> None:
        """Settle a video's Future once (close() may have failed it meanwhile) and close it."""
        with self.lock:
            self.mp4_s += seconds
            self.open.pop(number, None)
            if video.future.done():
                return
            if error is not None:
                video.future.set_exception(VideoFailed(" ".join(f"{type(error).__name__}: {error}".split())))
                return
            self.videos += 1
            self.last_video_at = time.perf_counter()
            self.video_seconds += self.last_video_at - video.submitted
            video.future.set_result(result)

    def _fail_open(self, error: BaseException) -> None:  # under self.lock
        for video in self.open.values():
            if not video.future.done():
                video.future.set_exception(error)
        self.open.clear()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item[1].future.done():
                item[1].future.set_exception(error)
