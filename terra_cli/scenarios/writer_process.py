"""Inside a video writer process (`scenarios.writers.WriterPool` starts them): frames decoded as the
engine makes them, an mp4 encoded once a video is done.

A scenario's frames arrive while it is generated (`frames` messages, its context first); the process
decodes them on the run's device whenever a full batch of the tokenizer's batch size has arrived, and
keeps the pixels. When the scenario is done (`finish`, with all its tokens), only the frames not decoded yet
(the last one, or all of them past the memory cap) are decoded, and the mp4 is encoded by one of a
few encoder threads (each runs its own ffmpeg), while this thread goes on decoding. So the videos of
a batch of rollouts that finish together are not decoded one after the other after the last token:
on an H100 that drain was 120-174 s of a 256-sample run with the whole video decoded at the end
(benchmarks/README.md, issue 37).

Every frame is decoded in a full batch (`ImageTokenizer.decode_tokens(full_batches=True)`), so its
pixels do not depend on which frames shared its batch: the mp4 is the one the run's writer thread
makes of the same tokens. A finished frame's tokens are compared with the ones decoded ahead; a
frame whose tokens differ is decoded again.

Messages in (tuples): ("frames", key, first index, tokens (n, T)); ("finish", key, tokens (F, T));
("drop", key); None to stop. Out: ("ready",), ("failed", message), ("done", key, mp4 bytes, frames
decoded after the finish), ("error", key, message). A reader thread moves the pipe's messages into a queue, so the engine's
side never waits on a pipe this process is too busy to read.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from terra_cli.compile_apart import fx_cache_counts
from terra_cli.scenarios.held_frames import HELD_FRAMES

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# TERRA_DECODER_COMPILE=0 keeps the tokenizer's decoder eager on CUDA (to compare; on by default).
DECODER_COMPILE_ENV = "TERRA_DECODER_COMPILE"


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
    encoders: int = 2  # mp4s encoded at once (each an ffmpeg process of its own)
    held_frames: int = HELD_FRAMES

    @staticmethod
    def of(tokenizer) -> dict | None:
        """The fields a worker needs from a loaded `ImageTokenizer`; None for a decoder that cannot
        be loaded again from a folder (random weights, the refiner)."""
        from tokenizer_decoder import ImageTokenizer

        if not isinstance(tokenizer, ImageTokenizer) or not tokenizer.source:
            return None
        return {"source": str(tokenizer.source), "device": str(tokenizer.device), "batch_size": tokenizer.batch_size,
                "image_size": tuple(tokenizer.image_size)}


def decoder_compiles(decoder) -> bool:
    """Whether the decode-ahead compiles `decoder`: an `ImageTokenizer` on CUDA, unless TERRA_DECODER_COMPILE=0."""
    from terra_cli.runtime import switched_off

    if switched_off(DECODER_COMPILE_ENV):
        return False
    return hasattr(decoder, "compile_decoder") and getattr(getattr(decoder, "device", None), "type", None) == "cuda"


def compile_decoder(decoder) -> bool:
    """Decode-ahead batches through the compiled decoder on CUDA (`ImageTokenizer.compile_decoder`),
    Inductor's cache in terra's cache folder, unless TERRA_DECODER_COMPILE=0. The first run on a
    machine pays the compile once, in the thread that decodes."""
    if not decoder_compiles(decoder):
        return False
    from terra_cli.refiner.compiled import use_inductor_cache
    from terra_cli.runtime import decoder_compile_mode_asked

    use_inductor_cache()
    return decoder.compile_decoder(mode=decoder_compile_mode_asked())


class FrameStore:
    """Frames decoded ahead, per video: (tokens, pixels) by frame index, and the rows that wait to be decoded."""

    def __init__(self, decoder, held_frames: int, before_first_decode: Callable[[], None] | None = None):
        self.decoder, self.limit = decoder, held_frames
        compile_decoder(decoder)
        # Called once, before the first decode: an in-process writer waits there for the child that
        # compiles this decoder into Inductor's cache (decoder_compile_apart), so its compile is a cache hit.
        # It returns False when the writer was closed meanwhile: then nothing more is decoded ahead.
        self._before_first_decode = before_first_decode
        self.decoding_ahead = True
        self.videos: dict[str, dict[int, tuple[np.ndarray, np.ndarray | None]]] = {}
        self.waiting: deque[tuple[str, int]] = deque()  # (key, index) not decoded yet
        self.count = 0  # frames held, decoded or waiting
        # What the decode-ahead did (a bench's engine rows): its batches, their frames, the first one's
        # seconds (with a compiled decoder, the compile, which shares the engine's process), and the
        # seconds of the others: beside the engine's steps a batch takes longer than alone, and the
        # product's ms a frame says how much of the card the decoding holds
        self.batches_ahead, self.frames_ahead, self.first_batch_s = 0, 0, None
        self.first_batch_cache: list[int] | None = None  # Inductor's FX-graph cache [hits, misses] in it
        self.ahead_s, self.frames_timed = 0.0, 0  # the batches after the first
        # Frames decoded when their video was done instead (past `held_frames`, or a batch still short), and
        # other videos' waiting frames decoded in those batches' padding
        self.frames_late, self.late_s, self.frames_filled = 0, 0.0, 0

    def add(self, key: str, first: int, tokens: np.ndarray) -> None:
        video = self.videos.setdefault(key, {})
        for offset, row in enumerate(tokens):
            if self.count >= self.limit:
                return  # decoded when the video is done
            index = first + offset
            if index not in video:
                self.count += 1
                self.waiting.append((key, index))
            video[index] = (np.array(row), None)

    def drop(self, key: str) -> None:
        self.count -= len(self.videos.pop(key, {}))

    def full_batch_waiting(self) -> bool:
        return self.decoding_ahead and len(self.waiting) >= self.decoder.batch_size

    def decode_waiting(self, partial: bool = False) -> bool:
        """Decode one batch of the frames that wait (of videos still held); returns whether it decoded.

        Only a full batch unless `partial`: every batch is padded to the decoder's batch size, so a
        writer that decoded each frame as it came would pay a whole batch per frame. When rollouts'
        frames end in different steps (continuous refill), frames arrive one at a time and such a
        writer kept the GPU busy with padding beside the engine (benchmarks/README.md, issue 37)."""
        batch = self._waiting_frames(self.decoder.batch_size)
        if not batch or (len(batch) < self.decoder.batch_size and not partial):
            self.waiting.extendleft(reversed(batch))  # (the stale entries passed over are gone)
            return False
        if not self._ready_to_decode():
            self.waiting.extendleft(reversed(batch))
            return False
        rows = np.stack([self.videos[key][index][0] for key, index in batch])
        first = self.first_batch_s is None
        cache_before = fx_cache_counts() if first else None
        started = time.perf_counter()
        for (key, index), pixels in zip(batch, self.decoder.decode_tokens(rows, full_batches=True)):
            self.videos[key][index] = (self.videos[key][index][0], pixels)
        seconds = time.perf_counter() - started
        if first:
            self.first_batch_s = seconds
            after = fx_cache_counts()
            self.first_batch_cache = [after[0] - cache_before[0], after[1] - cache_before[1]]
        else:  # (the first one's is the compile's, apart)
            self.ahead_s += seconds
            self.frames_timed += len(batch)
        self.batches_ahead += 1
        self.frames_ahead += len(batch)
        return True

    def _ready_to_decode(self) -> bool:
        """Whether to decode ahead, after the one call of `before_first_decode` (a video's end decodes
        what it needs regardless)."""
        hook, self._before_first_decode = self._before_first_decode, None
        if hook is not None and hook() is False:
            self.decoding_ahead = False
        return self.decoding_ahead

    def stats(self) -> dict:
        return {"decode_ahead_batches": self.batches_ahead, "decode_ahead_frames": self.frames_ahead,
                "decode_first_batch_s": self.first_batch_s, "decode_first_batch_cache": self.first_batch_cache,
                "decode_ahead_s": round(self.ahead_s, 3),
                "decode_ahead_timed_frames": self.frames_timed,
                "decode_late_frames": self.frames_late, "decode_late_s": round(self.late_s, 3),
                "decode_filled_frames": self.frames_filled, "decode_held_limit": self.limit}

    def take(self, key: str, tokens: np.ndarray) -> tuple[list[np.ndarray], int]:
        """Every frame of a finished video (F, T): the ones decoded ahead whose tokens match, the rest
        decoded now; and how many were decoded now."""
        held = self.videos.get(key, {})
        self.drop(key)
        frames: list[np.ndarray | None] = []
        for index, row in enumerate(tokens):
            entry = held.get(index)
            frames.append(entry[1] if entry is not None and entry[1] is not None and np.array_equal(entry[0], row)
                          else None)
        missing = [i for i, f in enumerate(frames) if f is None]
        if missing:
            self._ready_to_decode()
            started = time.perf_counter()
            # The batch is padded to the decoder's size anyway: other videos' waiting frames go in the padding.
            # When a wave of rollouts ends in one step, each video has a frame or two left; decoded alone,
            # every one paid a whole batch (256 batches a wave end, ~13 s of an H200 beside the engine).
            fill = self._waiting_frames(-len(missing) % self.decoder.batch_size)
            rows = np.concatenate([tokens[missing]] + [self.videos[key][index][0][None] for key, index in fill])
            try:
                decoded = self.decoder.decode_tokens(rows, full_batches=True)
            except Exception:
                if not fill:
                    raise
                # Another video's frame may be what failed: this video's frames alone, so that its error (or
                # success) is its own; the others are decoded, and fail if they must, at their own end.
                fill = []
                decoded = self.decoder.decode_tokens(tokens[missing], full_batches=True)
            for i, pixels in zip(missing, decoded[: len(missing)]):
                frames[i] = pixels
            for (key, index), pixels in zip(fill, decoded[len(missing):]):
                self.videos[key][index] = (self.videos[key][index][0], pixels)
            self.frames_late += len(missing)
            self.frames_filled += len(fill)
            self.late_s += time.perf_counter() - started
        return frames, len(missing)  # type: ignore[return-value]

    def _waiting_frames(self, count: int) -> list[tuple[str, int]]:
        """Up to `count` frames that wait to be decoded ahead (of videos still held), taken off the queue."""
        taken: list[tuple[str, int]] = []
        while self.decoding_ahead and self.waiting and len(taken) < count:
            key, index = self.waiting.popleft()
            entry = self.videos.get(key, {}).get(index)
            if entry is not None and entry[1] is None:
                taken.append((key, index))
        return taken


def serve(conn, spec: DecoderSpec) -> None:
    """A writer process's main function."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
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
        _send(conn, threading.Lock(), ("failed", " ".join(f"{type(exc).__name__}: {exc}".split())))
        return
    send_lock = threading.Lock()
    if not _send(conn, send_lock, ("ready",)):
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, inbox), name="terra-writer-inbox", daemon=True).start()
    drive(inbox, FrameStore(decoder, spec.held_frames), lambda message: _send(conn, send_lock, message), spec.fps,
          spec.folder, spec.encoders)


def drive(inbox: queue.SimpleQueue, store: FrameStore, reply: Callable[[tuple], object], fps: float, folder: str,
          encoders: int, tail_encoders: int | None = None, engine_done: threading.Event | None = None) -> None:
    """A writer's loop (a writer process's, and `local_writer.InProcessWriter`'s thread): take the
    messages of `inbox` until None, decode frames ahead, and answer each finished video through `reply`
    once it is encoded: `encoders` mp4s at once while any video it holds is still being generated,
    `tail_encoders` (default: as many) while none is. Then the engine has nothing in flight for this
    writer (a run's last videos, which all end together when they started together, or a Ray engine
    between calls) and the host's cores that its loop would need are idle. With `engine_done`
    (--videos-at-end), finished videos wait until it is set, then go on `tail_encoders`."""
    tail_encoders = max(encoders, tail_encoders or encoders)
    finished: deque[tuple[str, np.ndarray]] = deque()
    ready: deque[tuple[str, list, int]] = deque()  # decoded, waiting for an encoder
    busy_lock, busy = threading.Lock(), [0]

    def encoded(_future) -> None:
        with busy_lock:
            busy[0] -= 1
        inbox.put(("encoded",))  # wakes the loop: an encoder is free

    def encoders_now() -> int:
        if engine_done is not None:
            return tail_encoders if engine_done.is_set() else encoders
        done_keys = {key for key, _ in finished}
        running = any(key not in done_keys for key in store.videos)
        return encoders if running else tail_encoders

    def may_take() -> bool:
        return bool(finished) and (engine_done is None or engine_done.is_set())

    with ThreadPoolExecutor(max(1, tail_encoders), thread_name_prefix="terra-mp4") as encoding:

        def start_encodes(limit: int) -> None:
            while ready and busy[0] < limit:
                with busy_lock:
                    busy[0] += 1
                encoding.submit(_encode, reply, fps, folder, *ready.popleft()).add_done_callback(encoded)

        stopping = False
        while not stopping:
            # Blocks unless a done video, a full batch of frames or a video an encoder is free for waits: a
            # part batch waits for more frames (or for its video's end, when `take` decodes what is left).
            can_encode = bool(ready) and busy[0] < encoders_now()
            messages = [] if may_take() or can_encode or store.full_batch_waiting() else [inbox.get()]
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for message in messages:
                if message is None:
                    stopping = True
                elif message[0] == "frames":
                    store.add(message[1], message[2], message[3])
                elif message[0] == "finish":
                    finished.append((message[1], message[2]))
                elif message[0] == "drop":
                    store.drop(message[1])
                # ("engine done",) only wakes the loop: `engine_done` is set
            if may_take():  # a done video first: the run waits on it, not on frames of videos still running
                key, tokens = finished.popleft()
                try:
                    frames, late = store.take(key, tokens)
                except Exception as exc:  # this scenario's failure: recorded as failed, the run goes on
                    reply(("error", key, str(exc)))
                else:
                    ready.append((key, frames, late))
            elif store.full_batch_waiting():
                try:
                    store.decode_waiting()
                except Exception:  # such a frame is decoded again when its video is done, and fails there alone
                    store.waiting.clear()
            start_encodes(encoders_now())
        start_encodes(len(ready) + busy[0])  # told to stop: what is decoded is still encoded (the pool queues it)


def _encode(reply: Callable[[tuple], object], fps: float, folder: str, key: str, frames: list[np.ndarray],
            late: int) -> None:
    from terra_cli.media.frames import video_bytes

    try:
        message = ("done", key, video_bytes(frames, fps, folder), late)
    except Exception as exc:
        message = ("error", key, str(exc))
    reply(message)


def _read(conn, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        inbox.put(message)
        if message is None:
            return


def _send(conn, lock: threading.Lock, message) -> bool:
    try:
        with lock:
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
