"""The intake stage: scenario contexts to tokens. Contexts are read (and image contexts resized to
the tokenizer's frame size) by READ_THREADS threads ahead (`read_context`, `ReadAhead`), then
encoded in batches (`encode_batch`), all of it ahead of the engine (`encoded` in `EncodeAhead`'s
thread for a single engine's run; a Ray engine actor's intake thread uses `encode_batch`), so the
engine never waits on a JPEG or the encoder while it has work. A Ray run's driver reads the
contexts it ships the same way, ahead of the hand-out."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import numpy as np

from terra_cli.scenarios.spec import Scenario

ENCODE_BATCH = 16  # scenarios whose contexts are encoded together
STOP_WAIT_SECONDS = 1.0  # how long a finished run waits for the encoding thread to end
READ_THREADS = 8  # context readers (decoding and resizing a JPEG let go of the interpreter)
READ_AHEAD_BATCHES = 2  # a single engine's intake reads this many batches beyond the one it encodes


def encode_batch(contexts: list[tuple[np.ndarray | None, list[np.ndarray] | None]], tokenizer,
                 lock: threading.Lock | None = None) -> list[np.ndarray]:
    """Each context as tokens (K, T) int64: given tokens as they are, frames (RGB) encoded in one
    tokenizer call for the whole batch (under `lock`, where the tokenizer is shared)."""
    images = [frame for tokens, frames in contexts if tokens is None for frame in frames]
    if images:
        with lock if lock is not None else contextlib.nullcontext():
            rows = iter(tokenizer.tokenize(images))
    out = []
    for tokens, frames in contexts:
        out.append(np.asarray(tokens, dtype=np.int64) if tokens is not None
                   else np.stack([next(rows) for _ in frames]).astype(np.int64))
    return out


def read_context(s: Scenario, image_size: tuple[int, int] | None = None
                 ) -> tuple[np.ndarray | None, list[np.ndarray] | None]:
    """A scenario's context as (tokens, None) or (None, RGB frames at `image_size`, the tokenizer's
    frame size; default Terra's). Resized in the reading threads, the exact way the tokenizer would
    (a frame at its size comes back unchanged): decoding and resizing ACT-Bench's three 1600x900
    JPEGs costs ~100 ms of CPU a sample, which one thread paid for every sample before."""
    from tokenizer_decoder.tokenizer import resize_frames

    from terra_cli.pipeline.inputs import load_context_tokens, read_context_frames

    if s.context_tokens is not None:
        return load_context_tokens(s.context_tokens, s.context_frames), None
    if s.context_images:
        frames = read_context_frames(list(s.context_images), s.context_frames)
        return None, resize_frames(frames, image_size) if image_size is not None else resize_frames(frames)
    return None, _sample_road(s.context_frames)


def encoded(scenarios: list[Scenario], tokenizer, threads: int = READ_THREADS,
            times: dict | None = None) -> Iterator[tuple[Scenario, np.ndarray]]:
    """(scenario, context tokens (K, T)) in order; contexts read by `threads` threads up to
    READ_AHEAD_BATCHES batches ahead, image contexts encoded ENCODE_BATCH scenarios at a time.
    `times` (if given) sums `intake_read_wait_s` (waiting for reads) and `intake_encode_s`."""
    times = times if times is not None else {}
    image_size = getattr(tokenizer, "image_size", None)
    ahead = (READ_AHEAD_BATCHES + 1) * ENCODE_BATCH  # the batch to encode next and those read while it encodes
    reader = ReadAhead(lambda s: read_context(s, image_size), ahead=ahead, threads=threads)
    try:
        for start in range(0, len(scenarios), ENCODE_BATCH):
            reader.want(scenarios[start : start + ahead])
            chunk = scenarios[start : start + ENCODE_BATCH]
            began = time.perf_counter()
            contexts = [reader.take(s) for s in chunk]
            read = time.perf_counter()
            tokens = encode_batch(contexts, tokenizer)
            times["intake_read_wait_s"] = times.get("intake_read_wait_s", 0.0) + read - began
            times["intake_encode_s"] = times.get("intake_encode_s", 0.0) + time.perf_counter() - read
            yield from zip(chunk, tokens)
    finally:
        reader.close()


class EncodeAhead:
    """Scenarios' contexts read and encoded in a thread, ahead of the engine loop, into a bounded
    `JobFeed`: the engine keeps stepping while images are read and encoded, and its first frames
    start after the first ENCODE_BATCH scenarios instead of after a whole batch of them (on an
    H100, 42 s of encoding for 256 ACT-Bench samples, with the GPU idle, when the loop did it:
    benchmarks/README.md). A failure to read or encode is kept for `check()`, which the run calls
    after every frame and at its end; the feed closes then, so the driver finishes what is in
    flight and returns. `hold`: the feed's (`JobFeed`), which keeps the engine from taking new
    scenarios while it says so."""

    def __init__(self, scenarios: list[Scenario], tokenizer, make_job: Callable, ahead: int,
                 hold: Callable[[], bool] | None = None):
        from terra_cli.backends.driver import JobFeed

        self.feed = JobFeed(capacity=ahead, hold=hold)
        self.error: BaseException | None = None
        self.times: dict[str, float] = {}  # where the intake's time went (`encoded`), and when it was done
        self._began = time.perf_counter()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, args=(scenarios, tokenizer, make_job, cuda_device()),
                                        name="terra-encode-ahead", daemon=True)
        self._thread.start()

    def _work(self, scenarios: list[Scenario], tokenizer, make_job: Callable, cuda_device: int | None) -> None:
        try:
            if cuda_device is not None:  # a new thread starts on GPU 0, whatever this run's engine uses
                import torch

                torch.cuda.set_device(cuda_device)
            for s, context in encoded(scenarios, tokenizer, times=self.times):
                self.feed.put(make_job(s, context))
            self.times["intake_done_after_s"] = time.perf_counter() - self._began
        except BaseException as exc:
            if not self._stopping:  # (a put refused because the run stopped is no error)
                self.error = exc
        finally:
            self.feed.close()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """The run is over (done, failed or interrupted): the thread ends after the encode in
        progress, if any; an interrupt does not wait for it."""
        self._stopping = True
        self.feed.close()
        self._thread.join(STOP_WAIT_SECONDS)


def cuda_device() -> int | None:
    """The calling thread's current GPU, where CUDA is in use; None elsewhere."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def _sample_road(count: int) -> list[np.ndarray]:
    from terra_cli.models.default import sample_context_frames

    return list(sample_context_frames(count))


class ReadAhead:
    """A Ray driver's contexts, read by READ_THREADS threads before the hand-out asks for them.

    Read one at a time in the driver's loop, 1,152 ACT-Bench samples (three 1600x900 JPEGs each)
    for four engines' first batches took about a minute, engine after engine, and the wave change
    of a full run needed 900 more at once (benchmarks/README.md, 2026-11-27). `want` starts the
    reads of the scenarios next in line, at most `ahead` of them not yet taken; `take` returns one
    scenario's read (reading it now if it was not started) or raises that read's error."""

    def __init__(self, read: Callable[[Scenario], object], ahead: int, threads: int = READ_THREADS):
        self.read, self.ahead = read, ahead
        self.reading: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="terra-read-ahead")

    def want(self, next_in_line: Iterable[Scenario]) -> None:
        for s in next_in_line:
            if len(self.reading) >= self.ahead:
                return
            if s.id not in self.reading:
                self.reading[s.id] = self.pool.submit(self.read, s)

    def take(self, s: Scenario):
        future = self.reading.pop(s.id, None)
        return future.result() if future is not None else self.read(s)

    def close(self) -> None:
        """The run is over: reads not started are dropped, none is waited for."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.reading.clear()
